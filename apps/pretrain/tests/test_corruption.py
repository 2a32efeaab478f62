"""Silent corruption (training/integrity.py) named in the job, proven by injecting it (``PAR_INJECT``,
observe/inject.py) in one rank of a real run: a matmul wrong on every call (persistent), a bit flipped
once in an activation (transient), in a weight (the run stops naming the rank), in optimizer state (only
the copies' hashes see it). Assertions are on the class and the rank."""

import json

import pytest
import torch

from injected_runs import injected_train
from pretrain.training.integrity import odd_copies, spike, tensor_hash

STEPS = 4
BASE = ["--set", "model.layers=2", "--set", f"train.steps={STEPS}", "--set", "train.warmup_steps=1",
        "--set", "train.eval_every=0", "--set", "log.progress=false", "--set", "log.every=1",
        "--set", "log.integrity_every=1", "--set", "checkpoint.every=0", "--set", "train.nan_policy=skip",
        "--set", "train.global_batch=12"]  # over dp 2 and dp 3


def run(tmp_path, fault_ranks, spec: str, dp: int, sets=()):
    res, lines = injected_train(tmp_path, fault_ranks, spec, dp, BASE, sets)
    return res, [e for e in lines if e.get("event") in ("corruption", "copies_differ", "integrity_check")]


def stopped_naming(res, rank: int, words: str, nproc: int = 3) -> None:
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: silent corruption: "), res.stderr
    assert f"rank {rank} (host " in res.stderr and "GPU cpu" in res.stderr and words in res.stderr, res.stderr
    others = {r for r in range(nproc) if r != rank}
    assert not any(f"rank {r} (host" in res.stderr for r in others), res.stderr


@pytest.mark.timeout(180)
def test_a_matmul_wrong_on_every_call_is_persistent_and_stops_the_run_at_dp2(tmp_path, fault_ranks):
    """Two copies: the suspect's rerun differs from its peer's (a rerun on the suspect alone could not say)."""
    res, _ = run(tmp_path, fault_ranks, "matmul:1", 2)
    stopped_naming(res, 1, "computes wrong results persistently")


TP2 = ["parallel.tp=2"]  # dp2 x tp2: ranks 0-1 are replica 0 (tp ranks 0, 1), ranks 2-3 replica 1
CASES = {  # name: (spec, ranks, rank, what[, sets])
    "matmul-dp3": ("matmul:0", 3, 0, "persistent"),
    "activation-dp2": ("flip_activation:1:3", 2, 1, "transient"),
    "activation-dp3": ("flip_activation:2:3", 3, 2, "transient"),
    "weight-dp2": ("flip_weight:1:2", 2, 1, "persistent"),  # the copies differ; the flipped rank's loss tells
    "weight-dp3": ("flip_weight:2:2", 3, 2, "copy"),  # the majority of three names it
    "optimizer-state-dp3": ("flip_state:1:2", 3, 1, "copy"),  # no loss shows it: only a hash that covers it
    # a bit in the reduced gradient: that rank's norm is not finite, every replica drops the step alike
    # (the norms' finiteness is summed with the loss), the suspect's rerun is normal
    "grad-dp2": ("flip_grad:1:2", 2, 1, "transient"),
    "grad-dp3": ("flip_grad:0:2", 3, 0, "transient"),
    "grad-zero1-dp2": ("flip_grad:1:2", 2, 1, "transient", ["parallel.zero=optim"]),  # in its reduce-scattered shard
    # token ids past the vocabulary in dp rank 1's share: infinite wherever it is computed
    "bad-batch-dp2": ("bad_batch:1:3", 2, 1, "correct"),
    "bad-batch-dp3": ("bad_batch:2:3", 3, 2, "correct"),
    "matmul-dp2xtp2": ("matmul:3", 4, 3, "persistent", TP2),  # the rerun's first module output unlike replica 0's
    # a transient leaves the loss, which a replica's tp ranks share: each rank's rerun against its own first
    # run names the one where it entered. The loss is finite (a logit flipped to about 1e35) and the update
    # applied: the log step's check runs before it. On tp rank 1 (rank 3) the loss would name rank 2; at
    # step 3 its first positive logit is over 2, which the flip makes tiny: unseen
    "activation-dp2xtp2": ("flip_activation:2:3", 4, 2, "transient", TP2),
    "activation-tp-rank-1-dp2xtp2": ("flip_activation:3:2", 4, 3, "transient", TP2),
    # tp rank 1 of replica 1: its norm's output becomes inf, the next collective spreads it to rank 2 (whose
    # outputs change later): rank 3, not the first of the group, is named
    "hidden-tp-rank-1-dp2xtp2": ("flip_hidden:3:3", 4, 3, "transient", TP2),
    "weight-dp2xtp2": ("flip_weight:1:2", 4, 1, "copy", TP2),  # a replicated norm weight: 4 copies, one odd
    "optimizer-state-dp2xtp2": ("flip_state:2:2", 4, 2, "copy", TP2),
    "grad-dp2xtp2": ("flip_grad:3:2", 4, 3, "transient", TP2),
    "bad-batch-dp2xtp2": ("bad_batch:1:3", 4, 2, "correct", TP2),  # dp rank 1 is ranks 2-3
    # pp2 x dp2: ranks 0-1 stage 0 (dp 0, 1), ranks 2-3 stage 1; the wrong rank is not the one with the loss
    # (its rerun's outputs differ from an earlier chunk on). A matmul wrong on a stage without the head
    # moves the loss too little to be a suspect: not detected.
    # the loss is rank 3's; rank 1's rerun changed in chunk 0, rank 3's only in chunk 1
    "hidden-pp2-first-stage": ("flip_hidden:1:3", 4, 1, "transient", ["parallel.pp=2"]),
    "weight-pp2-1f1b-first-stage": ("flip_weight:1:2", 4, 1, "persistent", ["parallel.pp=2"]),  # loss: rank 3's
    "weight-pp2-zbv-middle-chunks": ("flip_weight:3:2", 4, 3, "persistent",  # chunks 1-2; loss: rank 1's
                                     ["parallel.pp=2", "parallel.schedule=zb-v", "model.layers=4"]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n if n == "activation-tp-rank-1-dp2xtp2" else
                                  pytest.param(n, marks=pytest.mark.extended) for n in CASES])
def test_the_class_and_the_rank_are_right(tmp_path, fault_ranks, name):
    spec, nproc, rank, what, *sets = CASES[name]
    res, events = run(tmp_path, fault_ranks, spec, nproc, *sets)
    if what in ("transient", "correct"):
        assert res.exit_code == 0, res.output
        found = [(e["class"], e["rank"]) for e in events if e["event"] == "corruption"]
        assert found == [(what, rank)], events
        if "hidden" in name or "activation" in name:  # by its fingerprints, not by the loss
            assert [e["named_by"] for e in events if e["event"] == "corruption"] == ["fingerprints"], events
    elif what == "persistent":
        stopped_naming(res, rank, "computes wrong results persistently", nproc)
    else:  # stopped at the flip's step, by the copy it flipped
        key = "master/" if "weight" in name else "exp_avg"
        stopped_naming(res, rank, f"holds a copy of {key}", nproc)
        steps = [r["step"] for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines()) if "loss" in r]
        assert steps == [1], steps  # the flip's step (2) is not logged: the check stops it

@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["state", pytest.param("weight", marks=pytest.mark.extended)])
def test_hsdp_replicas_are_compared(tmp_path, fault_ranks, kind):
    """dp4, ZeRO-3 sharded within 2 ranks and replicated over 2 groups: optimizer state (or a master weight
    shard) flipped on rank 3 differs from its HSDP replica's (two copies: logged, no majority to name one).
    At the last step: the next update would spread it. The check hashes no freed ZeRO-3 parameter (it crashed)."""
    res, events = run(tmp_path, fault_ranks, f"flip_{kind}:3:{STEPS}", 4,
                      ["parallel.zero=optim_grads_params", "parallel.hsdp_replicas=2"])
    assert res.exit_code == 0, res.output
    differ = [e for e in events if e["event"] == "copies_differ"]
    key = "exp_avg" if kind == "state" else "master/"
    assert differ and differ[0]["step"] == STEPS and differ[0]["key"].startswith(key), events
    assert 3 in differ[0]["ranks"] and len(differ[0]["ranks"]) == 2, differ


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_clean_pipeline_run_flags_nothing(tmp_path, fault_ranks):
    """pp2 x dp2: the stages hold other pieces, never compared (their work neither: test_stragglers.py)."""
    res, events = run(tmp_path, fault_ranks, "", 4, ["parallel.pp=2"])
    assert res.exit_code == 0, res.output
    assert [e["event"] for e in events] == ["integrity_check"] * STEPS, events
    assert all(e["odd"] == 0 and e["split"] == 0 and e["hashed_bytes"] > 0 for e in events)
    assert all(e["gather_ranks"] == 2 for e in events)  # the hashes gathered within a stage: never across


def test_injection_is_off_unless_asked_and_a_bad_spec_is_refused():
    from pretrain.errors import UsageError
    from pretrain.observe.inject import Faults, parse

    off = Faults(1, parse(""))
    assert not off.active and not off.bad_batch and not off.flip_grad
    assert not Faults(0, parse("flip_grad:1:2,slow:1:forward")).active  # another rank's
    assert Faults(3, parse("bad_batch:1:2")).bad_batch == {(1, 2)}  # the data's: every rank reads it so
    assert Faults(3, parse("flip_hidden:3:2")).flip_hidden == {2}
    for bad in ("flip_grad:1", "bad_batch:x:2", "flip_grad:1:0", "slow:1:nowhere", "matmul:1:2"):
        with pytest.raises(UsageError, match="PAR_INJECT"):
            parse(bad)


def test_the_hash_sees_every_bit_and_the_majority_names_the_odd_copy():
    t = torch.randn(64)
    for bit in (0, 22, 30, 31):
        flipped = t.clone()
        flipped.view(torch.int32)[17] ^= 1 << bit
        assert not torch.equal(tensor_hash(t), tensor_hash(flipped)), bit
    assert torch.equal(tensor_hash(t), tensor_hash(t.clone()))
    same, other = {"w": (1, 2)}, {"w": (1, 3)}
    assert odd_copies([same, same, other]) == ({"w": [2]}, {})
    assert odd_copies([same, other]) == ({}, {"w": [0, 1]})
    assert odd_copies([same, {"v": (9, 9)}]) == ({}, {})  # a piece held once (another stage) is compared with nothing
    assert spike(float("nan"), [5.0]) and spike(100.0, [5.5, 5.4]) and not spike(5.6, [5.5, 5.4])


def test_a_verdict_is_one_event_and_one_console_line(tmp_path, capsys):
    from pretrain.observe.metrics import MetricsLogger

    verdict = {"event": "corruption", "step": 3, "class": "transient", "rank": 1, "host": "node7", "gpu": "2",
               "suspect_step": 3, "micro_batch": 0, "suspect_loss": None}
    with MetricsLogger(tmp_path, total_steps=3, progress=False) as logger:
        logger.log(3, 5.0, step_time=0.1, integrity=[verdict])
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["class"] for e in lines if e.get("event") == "corruption"] == ["transient"]
    assert "step 3: corruption check: transient on rank 1 (host node7, GPU 2), step 3's micro-batch 0" \
        in capsys.readouterr().out


def test_the_rank_whose_own_rerun_changed_first_is_named():
    """A transient fault on tp rank 1 of a replica (rank 3): its first run's fingerprints differ from its own
    rerun's from module 2 on, rank 2's only after the collective that brought the wrong value (module 5).
    Planted bugs, each naming rank 2: the first rank of the group; comparing across replicas (rank 2's
    first run with rank 0's, whose data differ from the first module)."""
    from pretrain.training.fingerprints import earliest, first_change

    clean = [(0, v) for v in (11, 12, 13, 14, 15, 16)]
    rerun = {r: clean for r in range(4)}
    first = {0: [(0, v + 100) for _, v in clean], 1: [(0, v + 100) for _, v in clean],  # replica 0: other data
             2: clean[:5] + [(0, -1)], 3: clean[:2] + [(0, -1)] * 4}
    changes = {r: first_change(first[r], rerun[r]) for r in (2, 3)}
    assert changes == {2: (0, 5), 3: (0, 2)}
    assert earliest(changes, suspect=2) == 3
    assert earliest({2: None, 3: None}, suspect=2) == 2  # nothing changed (a bad batch, a flipped gradient)
    assert first_change(clean, clean + [(1, 9)]) == (1, 0) and first_change(clean, clean[:3]) == (0, 3)
    # a later chunk comes after every module of an earlier one
    assert earliest({2: (1, 0), 3: (0, 4)}, suspect=2) == 3
    first_of_group = min(r for r, at in changes.items() if at is not None)
    across = {r: first_change(first[r], first[r - 2]) for r in (2, 3)}
    assert first_of_group == 2 and earliest(across, suspect=2) == 2


def test_a_forward_keeps_one_fingerprint_per_module_output_and_drops_them_at_an_update():
    """The fingerprint sees any flipped bit; recorded only inside a micro-batch's forward (not a
    recompute); an applied update drops them (other weights)."""
    from pretrain.training.fingerprints import RERUN, Fingerprints, fingerprint

    t = torch.randn(32)
    for bit in (0, 22, 30, 31):
        flipped = t.clone()
        flipped.view(torch.int32)[5] ^= 1 << bit
        assert fingerprint(flipped) != fingerprint(t), bit
    chunk = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    prints, x = Fingerprints({0: chunk}, on=True), torch.randn(3, 4)
    with prints.forward(7, 0, 1):
        prints.output(chunk(x))
    chunk(x)  # outside a forward: a recompute
    with prints.forward(RERUN, 0, 0):
        prints.output(chunk(x))
    first, rerun = prints.of(7, 1), prints.of(RERUN, 0)
    assert len(first) == 5 and first == rerun  # 3 modules, the Sequential, its output as it left
    assert prints.take_cost()["fingerprint_bytes"] == 5 * 8
    prints.updated()
    assert prints.of(7, 1) is None
    assert Fingerprints({0: chunk}, on=False).of(7, 1) is None
