"""``[train].buddy_shards = 1`` with expert parallelism (ZeRO-1/2 over the whole dp, ep > 1): a replica is an
expert-parallel group of consecutive dp ranks. The dense params' buddy is the shard of the next replica's rank at the
same place (par_zero's ``buddy_stride`` = ep x cp), the experts' (sharded over the expert-dp group, cp ranks per
replica) the expert-dp rank cp further's. A replica killed with SIGKILL leaves both on the survivors; they re-shard the dense params
over the dp survivors and the experts over the expert-dp survivors (training/replica_reshard.py), go on with the
uninterrupted ZeRO-1 run's curve, and a replacement that rejoins receives its pieces of both, bitwise. `plan`
counts the experts' buddy shards in the optimizer state, the gradients' all-reduce and a joiner's bytes."""

import json
import math
import os

import pytest
from typer.testing import CliRunner

from one_error_line import assert_one_error_line, snapshot
from pretrain.cli import app
from pretrain.config import load_config
from test_replica_faults import ZERO1, _check_fault_run, _moe, reference  # noqa: F401  (reference: the module fixture)

EP_ZERO1 = (*ZERO1, *_moe("none"))
EP_BUDDY = (*EP_ZERO1, "--set", "train.buddy_shards=1")
OLD_REFUSAL = "ep=1 and an element-wise optimizer"  # the one line ep > 1 met before


def _sets(layout: tuple) -> list[str]:
    return [a for a in layout if a != "--set"]


def test_ep_with_zero1_buddy_shards_is_no_longer_refused_under_fault_tolerance():
    """The layout once refused in one line (``buddy_shards=1 runs with ... ep=1``) validates at dp4 x ep2."""
    sets = _sets(EP_BUDDY) + ["train.fault_tolerance=replica", "model.hidden=32", "model.ffn_hidden=64"]
    layout = load_config(None, sets).validate_world(4)
    assert (layout.dp, layout.ep, layout.edp) == (4, 2, 2)
    for zero in ("optim", "optim_grads"):
        load_config(None, sets + [f"parallel.zero={zero}"]).validate_world(4)


SMALL = ["--set", "model.layers=2", "--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set",
         "train.eval_every=0", "--set", "log.progress=false", "--set", "train.fault_tolerance=replica",
         "--set", "train.buddy_shards=1", "tiny-moe", "--set", "parallel.ep=2"]
REFUSED = {
    "zero-3 buddy shards with ep": (["--nproc", "4", "--set", "parallel.zero=optim_grads_params"],
                                    "with [parallel].ep=2 runs with zero='optim' or 'optim_grads' (ZeRO-1/2) so far"),
    "expert re-placement": (["--nproc", "4", "--set", "parallel.zero=optim", "--set", "model.expert_balance=replicate+replace"],
                            "runs without [model].expert_balance='replicate+replace' so far"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_expert_buddy_shards_do_not_cover_is_one_error_line(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    args, words = REFUSED[name]
    res = CliRunner().invoke(app, ["train", *SMALL, *args, "--set", "log.dir=run"])
    assert_one_error_line(res, name, words)
    assert OLD_REFUSAL not in res.output
    assert snapshot(tmp_path) == {}, name


def _plan(*sets: str) -> dict:
    args = [a for s in ("parallel.ep=2", "parallel.zero=optim", "train.fault_tolerance=replica", *sets)
            for a in ("--set", s)]
    res = CliRunner().invoke(app, ["plan", "tiny-moe", "--world", "4", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_plan_counts_the_experts_buddy_shards_their_all_reduce_and_a_joiners_bytes():
    """dp4 x ep2 (edp 2): the buddy doubles the dense params' optimizer shard (over 4) and the experts' (over 2); the
    gradients' all-reduce sends 3/4 of the dense buffer and 1/2 of the experts' once more; a joiner receives two
    shards of each (masters and moments) and the routers' bias."""
    plain, buddy = _plan("train.fault_tolerance=off"), _plan("train.buddy_shards=1")
    dense, experts = plain["params"]["per_rank_dense"], plain["params"]["per_rank_experts"]
    per = 4 + 8  # fp32 masters of bf16 params, AdamW's moments
    mine = dense * per / 4 + experts * per / 2
    assert math.isclose(plain["model_state"]["optim"]["optim"], mine)
    assert buddy["model_state"]["optim"]["optim"] == 2 * plain["model_state"]["optim"]["optim"]
    ft = buddy["fault_tolerance"]
    assert ft["buddy"] == {"optim_bytes": mine, "grad_bytes_per_step": (dense * 3 / 4 + experts / 2) * 4}
    from pretrain.sizing.replicas import stage_moe_layers

    cfg = load_config("tiny-moe", ["parallel.ep=2"])
    bias = 4 * cfg.model.num_experts * stage_moe_layers(cfg, cfg.validate_world(4), 0)  # fp32, whole
    assert ft["joiner_bytes"] == (2 * -(-dense // 4) + 2 * -(-experts // 2)) * per + bias


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,step,phase", [(3, 2, "backward"), pytest.param(1, 2, "optimizer", marks=pytest.mark.skipif(
    not os.environ.get("PAR_FULL_MATRIX"), reason="the log holder's replica killed in its optimizer step: PAR_FULL_MATRIX=1"))])
def test_dp2_x_ep2_zero1_buddy_shards_a_replica_killed_rejoins_with_dense_and_expert_shards_bitwise(
        tmp_path, reference, fault_ranks, rank, step, phase):  # noqa: F811
    """4 ranks, two expert-parallel replicas: the survivor replica steps the lost one's dense and expert shards as
    buddies, goes on alone, and re-shards both over the four ranks when the replacement rejoins before step 4:
    every step's loss and grad norm the uninterrupted ZeRO-1 run's (1e-6), every sample once, each rank's buddy
    ranges the next replica's own pieces bitwise, the joiner's bytes `plan`'s."""
    _check_fault_run(tmp_path, 4, rank, step, phase, reference, layout=EP_BUDDY, admit_before=4, shard=2,
                     reference_layout=EP_ZERO1)


CP2 = ("--set", "parallel.cp=2")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason="the same stride over a replica's cp ranks: PAR_FULL_MATRIX=1")
def test_dp2_x_cp2_zero1_buddy_shards_keep_each_dense_buddy_on_the_other_replica(tmp_path, reference, fault_ranks):  # noqa: F811
    """A replica's cp ranks lie consecutive in the dp x cp sharding group as an expert-parallel group's do: each
    dense buddy is the other replica's rank at the same cp coordinate (``buddy_stride`` = cp), so the replica
    killed leaves every shard on the survivors."""
    _check_fault_run(tmp_path, 2, 3, 2, "backward", reference, layout=(*ZERO1, *CP2, "--set", "train.buddy_shards=1"),
                     admit_before=4, reference_layout=(*ZERO1, *CP2))


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason="8 ranks; the strides are checked up front by "
                    "test_replica_copies_order.py: PAR_FULL_MATRIX=1")
def test_dp4_x_cp2_x_ep2_zero1_buddy_shards_keep_the_expert_buddies_on_the_other_replica(tmp_path, reference, fault_ranks):  # noqa: F811
    """An expert-parallel group is one dp rank's two cp ranks, so a replica (2 dp ranks, 4 ranks) holds two expert-dp
    ranks: an expert buddy lies cp ranks on in the expert-dp group (at 1 it was in its own replica, lost with it)."""
    _check_fault_run(tmp_path, 4, 5, 2, "backward", reference, layout=(*EP_BUDDY, *CP2), admit_before=4, shard=2,
                     reference_layout=(*EP_ZERO1, *CP2))
