"""`pretrain plan` and `--simulate` under [model].expert_balance = "replicate" (issue 51, item 4): the
replica buffers and the weight-fetch / gradient-return bytes, by hand from tiny-moe's shapes, and in a
simulated step the recorded all-to-all (and the all-to-all dispatcher's count all-gather) bytes of the
EP group equal sizing/replicas.py's, under both dispatchers."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()
EP2 = ["tiny-moe", "--world", "4", "--set", "parallel.ep=2"]
REPLICATE = ["--set", "model.expert_balance=replicate"]
# tiny-moe: hidden 64, moe_ffn_hidden 64, 8 layers from layer 1 on MoE; plan's convention is bf16
ONE_REPLICA = 3 * 64 * 64 * 2  # w_gate, w_up, w_down of one expert
MOE_LAYERS, MOST = 7, 2  # max_replicas_per_rank's default


def plan(*args):
    res = runner.invoke(app, ["plan", *args])
    assert res.exit_code == 0, res.output
    return res.stdout


def test_plan_counts_the_replica_buffers_and_bytes_by_hand():
    r = json.loads(plan(*EP2, *REPLICATE, "--json"))["replicas"]
    assert (r["bytes_per_replica"], r["moe_layers"], r["microbatches"]) == (ONE_REPLICA, MOE_LAYERS, 1)
    assert r["held_per_microbatch"] == MOE_LAYERS * MOST * ONE_REPLICA
    assert r["gradient_buffer"] == MOST * ONE_REPLICA
    assert r["fetch_bytes_per_step_max"] == r["return_bytes_per_step_max"] == MOE_LAYERS * MOST * ONE_REPLICA
    # two micro-batches per step: twice the bytes, the same held per micro-batch
    two = json.loads(plan(*EP2, *REPLICATE, "--set", "train.micro_batch=1", "--json"))["replicas"]
    assert two["microbatches"] == 2 and two["fetch_bytes_per_step_max"] == 2 * r["fetch_bytes_per_step_max"]
    text = plan(*EP2, *REPLICATE)
    assert "replicas (expert_balance=replicate): at most 2 per MoE layer, 24.58 KB each; held 344.06 KB" in text


def test_plan_without_replicate_is_unchanged_and_replicate_adds_only_its_buffers():
    none = json.loads(plan(*EP2, "--json"))
    assert none == json.loads(plan(*EP2, "--set", "model.expert_balance=none", "--json")) and "replicas" not in none
    rep = json.loads(plan(*EP2, *REPLICATE, "--json"))
    r = rep.pop("replicas")
    changed = {k for k in rep if rep[k] != none[k]}
    assert changed == {"activations", "peak_gb"}, changed
    # the saved replica weights of every MoE layer, and at most one layer's replica gradients
    grown = rep["activations"]["total"] - none["activations"]["total"]
    assert r["held_per_microbatch"] <= grown <= r["held_per_microbatch"] + r["gradient_buffer"]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_simulate_records_the_planned_replica_bytes(dispatcher):
    from pretrain.config import load_config
    from pretrain.simulate.report import simulate
    from pretrain.sizing.activations import routed_sizes
    from pretrain.sizing.replicas import declared_plan
    from par_moe import DeclaredRouting

    cfg = load_config("tiny-moe", ["parallel.ep=2", "model.expert_balance=replicate", f"model.dispatcher={dispatcher}"])
    result = simulate(cfg, 4, [0, 1], imbalance=3.0)
    layout = cfg.validate_world(4)
    for rank in result["ranks"]:
        ep_rank = rank["coords"]["ep"]
        plan = declared_plan(cfg, layout, routed_sizes(cfg, layout, DeclaredRouting(3.0), ep_rank).pairs)
        r = rank["replicas"]
        assert r["fetch_sent_per_step"] == MOE_LAYERS * plan.fetched(ep_rank) * ONE_REPLICA
        assert r["fetch_received_per_step"] == MOE_LAYERS * len(plan.replicas[ep_rank]) * ONE_REPLICA
        assert r["slots_max_over_mean_after"] < r["slots_max_over_mean_before"]  # expert 0's excess moved
        rows = {(c["op"], c["group"]): c for c in rank["collectives"]}
        keys = (("all_to_all", "ep"),) + ((("all_gather", "ep"),) if dispatcher == "alltoall" else ())
        for key in keys:  # exact: the replicas' bytes are whole
            assert rows[key]["bytes"] == rows[key]["theory_bytes"], (rank["rank"], key, rows[key])
    sent, received = (sum(r["replicas"][k] for r in result["ranks"]) for k in ("fetch_sent_per_step", "fetch_received_per_step"))
    assert sent == received > 0  # what EP rank 0 sends, EP rank 1 receives


# ep4 on two nodes of two GPUs, one NVLink domain each (as tests/test_layouts_expert_balance.py)
DOMAIN_PAIRS = 'preset = "dgx-h100"\nnodes = 2\ngpus_per_node = 2\nnvlink_domain_gpus = 2\n'


@pytest.mark.parametrize("across", [False, True])
def test_simulate_plans_the_replicas_in_the_described_nvlink_domains(tmp_path, across):
    """The simulated step plans as a run on the described cluster does: expert 0's replicas stay in its
    home rank's NVLink domain unless replicate_across_domains; the recorded all-to-all bytes are the
    domain-aware plan's (sizing.replicas.declared_plan), rank by rank."""
    from par_moe import DeclaredRouting
    from pretrain.config import load_config
    from pretrain.simulate.report import simulate
    from pretrain.sizing.activations import routed_sizes
    from pretrain.sizing.replicas import declared_domains, declared_plan

    topology = tmp_path / "pairs.toml"
    topology.write_text(DOMAIN_PAIRS)
    cfg = load_config("tiny-moe", ["parallel.ep=4", "model.expert_balance=replicate", f"topology.file={topology}",
                                   f"model.replicate_across_domains={str(across).lower()}"])
    layout = cfg.validate_world(4)
    domains = declared_domains(cfg, layout)
    assert domains is not None and sorted(domains) == [0, 0, 1, 1], domains
    plan = declared_plan(cfg, layout, routed_sizes(cfg, layout, DeclaredRouting(3.0), 0).pairs)
    crossing = [(e, r) for e, segs in enumerate(plan.segments) for r, _ in segs[1:] if domains[r] != domains[segs[0][0]]]
    assert len(plan.segments[0]) > 1 and bool(crossing) == across, plan.segments  # expert 0 replicated
    result = simulate(cfg, 4, [0, 1, 2, 3], imbalance=3.0)
    print(f"across={across}: EP ranks' domains {domains}, replicas {plan.replicas}, crossing domains {crossing}")
    for rank in result["ranks"]:
        ep_rank = rank["coords"]["ep"]
        assert rank["replicas"]["fetch_received_per_step"] == MOE_LAYERS * len(plan.replicas[ep_rank]) * ONE_REPLICA
        # ep = world: the report names the one group of all four ranks "dp" when it records, "ep" in theory
        a2a = [c for c in rank["collectives"] if c["op"] == "all_to_all"]
        recorded, theory = sum(c["bytes"] for c in a2a), sum(c.get("theory_bytes") or 0 for c in a2a)
        assert recorded == theory > 0, (rank["rank"], a2a)
