"""Muon under par's ZeRO-1 over the whole dp with ``[train].buddy_shards = 1``: each rank also steps the next rank's
shard (its momentum, AdamW moments and master) from the all-reduced gradients, applying the owners'
orthogonalized update that its own step's all-reduce left it (par_zero/muon_buddy.py). A replica killed in the
optimizer step leaves its shard on its buddy; the survivor goes on alone with the uninterrupted ZeRO-1 Muon run's
curve, and the replacement that rejoins receives its shard and its buddy's, momentum included, bitwise (the bytes
``plan`` says)."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from test_replica_faults import _check_buddy_resume, _check_fault_run, reference  # noqa: F401  (reference: the module fixture)

MUON_ZERO1 = ("--set", "parallel.zero=optim", "--set", "train.optimizer=muon")


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_dp2_muon_zero1_with_buddy_shards_killed_in_the_optimizer_step_rejoins_with_the_momentum_bitwise(
        tmp_path, reference, fault_ranks):  # noqa: F811
    _check_fault_run(tmp_path, 2, 1, 2, "optimizer", reference, layout=(*MUON_ZERO1, "--set", "train.buddy_shards=1"),
                     admit_before=4, reference_layout=MUON_ZERO1)


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_muon_resume_with_buddy_shards_reads_each_buddy_momentum_from_its_owners_pieces(tmp_path, fault_ranks):
    """Muon's buddy state is unpacked copies over the range while a checkpoint loads (as its owner's): a resume fills
    them and packs them back, so each buddy's momentum and moments are its owner's bitwise again, not zeros."""
    _check_buddy_resume(tmp_path, (*MUON_ZERO1, "--set", "train.buddy_shards=1"))


def _plan(*overrides: str) -> dict:
    sets = [a for o in ("parallel.tp=1", "train.optimizer=muon", *overrides) for a in ("--set", o)]
    res = CliRunner().invoke(app, ["plan", "llama3-8b", "--world", "8", "--json", *sets])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_plan_counts_the_muon_buddy_shard_its_momentum_and_the_joiners_bytes():
    """Muon with buddy shards (ZeRO-1, dp 8): a second shard of the masters, momentum and AdamW moments per rank; a
    joiner receives both shards of every kind, unpacked over its ranges as the re-shard sends them (4 + 3 x 4 bytes
    per element); the owners' results (bf16) are all-reduced over dp in place of their reduce-scatter: (d - 1) / d of the
    Muon matrices' 2 bytes once more per step."""
    plain = _plan("parallel.zero=optim")
    buddy = _plan("parallel.zero=optim", "train.fault_tolerance=replica", "train.buddy_shards=1",
                  "checkpoint.async_save=false")
    n = plain["params"]["per_rank_dense"]
    assert buddy["model_state"]["optim"]["optim"] == 2 * plain["model_state"]["optim"]["optim"]
    assert buddy["fault_tolerance"]["buddy"]["optim_bytes"] == plain["model_state"]["optim"]["optim"]
    assert buddy["fault_tolerance"]["joiner_bytes"] == 2 * -(-n // 8) * (4 + 3 * 4)
    muon = buddy["optimizer"]["muon_params"]
    assert 0 < muon < n
    assert buddy["fault_tolerance"]["buddy"]["muon_bytes_per_step"] == pytest.approx(2 * muon * 7 / 8, rel=1e-6)


def test_simulate_measures_the_muon_buddy_shards_as_planned():
    """The trainer's Muon buddies on fake tensors (tp 2 x dp 4, ZeRO-1): optimizer bytes as planned, and over dp an
    all-reduce (the gradients' and the owners' results) and all-gathers (the updates', the params') as planned."""
    from pretrain.config import load_config
    from pretrain.simulate.report import simulate

    cfg = load_config("llama3-8b", ["model.layers=2", "train.global_batch=32", "parallel.tp=2", "parallel.zero=optim",
                                    "train.buddy_shards=1", "train.optimizer=muon"])
    rank = simulate(cfg, 8, [0])["ranks"][0]
    assert rank["measured"]["optim"] == pytest.approx(rank["planned"]["optim"], rel=0.02)
    dp = {c["op"]: c for c in rank["collectives"] if c["group"] == "dp"}
    assert set(dp) == {"all_reduce", "all_gather"}, dp
    assert dp["all_reduce"]["ratio"] == pytest.approx(1.0, rel=0.01), dp
    assert dp["all_gather"]["ratio"] == pytest.approx(1.0, rel=0.01), dp
