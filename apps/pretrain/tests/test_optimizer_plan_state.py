"""`pretrain plan` sizes the optimizer state its par-zero declaration names: SGD's momentum (none without
one), Lion's momentum, a torch.optim class's tensors (Adagrad's ``sum``), beside the fp32 main weights of a
bf16 run; `plan --simulate` (the trainer's real optimizer on fake tensors) holds what the plan says."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

MAIN = 4  # fp32 main weights (bf16 params)
# id: (overrides, state bytes per parameter)
CASES = {
    "sgd-momentum": (["train.optimizer=sgd", "train.optimizer_args={momentum=0.9, nesterov=true}"], 4),
    "sgd": (["train.optimizer=sgd"], 0),
    "lion": (["train.optimizer=lion", "train.optimizer_args={betas=[0.9, 0.95]}"], 4),
    "adagrad": (["train.optimizer=adagrad", "parallel.zero=no_shard"], 4),
}


def plan(overrides, world=8):
    sets = [a for o in ["parallel.tp=1"] + overrides for a in ("--set", o)]
    res = CliRunner().invoke(app, ["plan", "llama3-8b", "--world", str(world), "--json", *sets])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_plan_counts_the_declared_state_per_parameter():
    """One rank per pipeline (every rank holds the whole model, dp = 8): the optimizer bytes are N x
    (main weights + the declared state) under DDP, a dp-th of it under ZeRO-1; params and grads alike."""
    out = {name: plan(overrides) for name, (overrides, _) in CASES.items()}
    n = out["sgd"]["params"]["per_rank_dense"] + out["sgd"]["params"]["per_rank_experts"]
    for name, (_, state) in CASES.items():
        table = out[name]["model_state"]
        assert table["no_shard"]["optim"] == n * (MAIN + state), name
        assert table["optim"]["optim"] == n * (MAIN + state) / 8, name
        for kind in ("params", "grads"):
            assert table["optim"][kind] == out["sgd"]["model_state"]["optim"][kind], (name, kind)
    assert "2 + 4 + 8 bytes per parameter" in out["lion"]["convention"]
    assert "no optimizer state + fp32 main weights: 2 + 4 + 4" in out["sgd"]["convention"]


@pytest.mark.parametrize("name", ["sgd-momentum", "lion"])
def test_simulate_measures_the_declared_state_as_planned(name):
    """The bytes the trainer's SGD / Lion hold (fake tensors; ZeRO-3 over dp 16 of tp 2 x pp 2) are the plan's, within 2 %."""
    from pretrain.config import load_config
    from pretrain.simulate.report import simulate

    cfg = load_config("llama3-8b", ["model.layers=2", "train.global_batch=32", "parallel.tp=2", "parallel.pp=2",
                                    "parallel.zero=optim_grads_params"] + CASES[name][0])
    rank = simulate(cfg, 64, [0])["ranks"][0]
    assert rank["measured"]["optim"] == pytest.approx(rank["planned"]["optim"], rel=0.02)


BUDDY = ["parallel.zero=optim", "train.fault_tolerance=replica", "train.buddy_shards=1", "checkpoint.async_save=false"]


def test_plan_counts_the_buddy_shard_of_optimizer_state_and_its_bytes():
    """[train].buddy_shards = 1 (ZeRO-1, dp 8): a second shard of the main weights and moments per rank; a joiner
    receives both shards; the gradients' all-reduce sends (d - 1) / d of them once more than a reduce-scatter."""
    plain, buddy = plan(["parallel.zero=optim"]), plan(BUDDY)
    n = plain["params"]["per_rank_dense"]
    assert buddy["model_state"]["optim"]["optim"] == 2 * plain["model_state"]["optim"]["optim"] == 2 * n * (MAIN + 8) / 8
    assert buddy["model_state"]["no_shard"] == plain["model_state"]["no_shard"]
    ft = buddy["fault_tolerance"]
    assert ft["buddy"] == {"optim_bytes": plain["model_state"]["optim"]["optim"],
                           "grad_bytes_per_step": plain["model_state"]["optim"]["grads"] * 7 / 8}
    assert ft["joiner_bytes"] == 2 * -(-n // 8) * (MAIN + 8)


def test_plan_counts_the_buddy_shards_of_zero2_its_gradient_shard_and_bytes():
    """Under ZeRO-2 (dp 8) a buddy holds a second shard of the reduced gradients too, and the all-reduce sends
    (d - 1) / d of the full gradient buffer (eight of ZeRO-2's shards) once more."""
    zero2 = ["parallel.zero=optim_grads"]
    plain, buddy = plan(zero2), plan([*zero2, *BUDDY[1:]])
    n = plain["params"]["per_rank_dense"]
    mine, theirs = plain["model_state"]["optim_grads"], buddy["model_state"]["optim_grads"]
    assert theirs["optim"] == 2 * mine["optim"] and theirs["grads"] == 2 * mine["grads"]
    assert buddy["fault_tolerance"]["buddy"] == {"optim_bytes": mine["optim"], "grad_bytes": mine["grads"],
                                                 "grad_bytes_per_step": mine["grads"] * 8 * 7 / 8}
    assert buddy["fault_tolerance"]["joiner_bytes"] == 2 * -(-n // 8) * (MAIN + 8)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_plan_counts_the_buddy_shards_of_zero3_its_param_and_gradient_shards_and_bytes(dtype):
    """Under par's ZeRO-3 (dp 8) a buddy holds a second shard of the reduced gradients and of the optimizer state,
    and in fp32 (its master is the next rank's param shard) a second param shard; the gradients are all-reduced
    (eight of ZeRO-3's shards, (d - 1) / d of them once more than a reduce-scatter); a joiner receives two shards."""
    zero3 = ["parallel.zero=optim_grads_params", f"train.dtype={dtype}"]
    plain, buddy = plan(zero3), plan([*zero3, *BUDDY[1:]])
    n = plain["params"]["per_rank_dense"]
    mine, theirs = plain["model_state"]["optim_grads_params"], buddy["model_state"]["optim_grads_params"]
    assert theirs["optim"] == 2 * mine["optim"] and theirs["grads"] == 2 * mine["grads"]
    assert theirs["params"] == (2 if dtype == "fp32" else 1) * mine["params"]
    assert buddy["model_state"]["optim_grads"] != plain["model_state"]["optim_grads"]  # each ZeRO row as if chosen
    assert buddy["fault_tolerance"]["buddy"] == {"optim_bytes": mine["optim"], "grad_bytes": mine["grads"],
                                                 **({"param_bytes": mine["params"]} if dtype == "fp32" else {}),
                                                 "grad_bytes_per_step": mine["grads"] * 8 * 7 / 8}
    assert buddy["fault_tolerance"]["joiner_bytes"] == 2 * -(-n // 8) * (4 + 8)  # fp32 masters and moments


@pytest.mark.extended
@pytest.mark.parametrize("zero", ["optim", "optim_grads", "optim_grads_params"])
def test_simulate_measures_the_buddy_shards_as_planned(zero):
    """The trainer's buddies on fake tensors (tp 2 x dp 4): optimizer bytes (and ZeRO-2's gradient shards) and the
    dp all-reduce as planned."""
    from pretrain.config import load_config
    from pretrain.simulate.report import simulate

    cfg = load_config("llama3-8b", ["model.layers=2", "train.global_batch=32", "parallel.tp=2", f"parallel.zero={zero}",
                                    "train.buddy_shards=1"])
    rank = simulate(cfg, 8, [0])["ranks"][0]
    assert rank["measured"]["optim"] == pytest.approx(rank["planned"]["optim"], rel=0.02)
    if zero != "optim":
        assert rank["measured"]["grads"] == pytest.approx(rank["planned"]["grads"], rel=0.02), rank
        assert rank["measured"]["params"] == pytest.approx(rank["planned"]["params"], rel=0.02), rank
    dp = {c["op"]: c for c in rank["collectives"] if c["group"] == "dp"}
    assert set(dp) == {"all_reduce", "all_gather"}
    assert dp["all_reduce"]["ratio"] == pytest.approx(1.0, rel=0.01), dp
