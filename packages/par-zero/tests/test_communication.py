"""What each strategy sends per step, counted by par_groups.comm (tiny model: 3 layers, 187 params)."""

import pytest
import torch.distributed as dist
from torch import nn

from par_groups import CommRecorder
from par_zero import DataParallel
from par_zero.testing import LOCAL_B, batches, tiny_model

WORLD = 4
CASES = {
    "no_shard": dict(strategy="no_shard"),
    "optim": dict(strategy="optim"),
    "optim_grads": dict(strategy="optim_grads"),
    "optim_grads_params": dict(strategy="optim_grads_params"),
    "zero3-no-reshard": dict(strategy="optim_grads_params", reshard_after_forward=False),
}


def record_one_step(world: int) -> dict:
    rank = dist.get_rank()
    x, y = batches(world)[0][0]
    x, y = x[rank * LOCAL_B : (rank + 1) * LOCAL_B], y[rank * LOCAL_B : (rank + 1) * LOCAL_B]
    out = {}
    for name, kw in CASES.items():
        dp = DataParallel(tiny_model(), None, bucket_mb=1.0, **kw)  # one bucket per family / layer
        phases = {}
        with dp.no_sync():  # an accumulation micro-batch first: no grad communication
            with CommRecorder() as rec:
                nn.functional.mse_loss(dp(x), y).backward()
            phases["accumulate"] = [(r.op, r.bytes) for r in rec.records]
        with CommRecorder() as rec:
            loss = nn.functional.mse_loss(dp(x), y)
        phases["forward"] = [(r.op, r.bytes) for r in rec.records]
        with CommRecorder() as rec:
            loss.backward()
        phases["backward"] = [(r.op, r.bytes) for r in rec.records]
        with CommRecorder() as rec:
            dp.step()
        phases["step"] = [(r.op, r.bytes) for r in rec.records]
        out[name] = phases
    return out


@pytest.fixture(scope="module")
def comm(dist_run):
    return dist_run(WORLD, record_one_step, WORLD, timeout=600)[0]


def _ops(records, op):
    return [b for o, b in records if o == op]


def test_ddp_sends_one_all_reduce_of_all_grads(comm):
    c = comm["no_shard"]
    assert c["forward"] == [] and c["step"] == [] and c["accumulate"] == []
    [(op, nbytes)] = c["backward"]
    assert op == "all_reduce" and 187 * 4 <= nbytes < (187 + WORLD) * 4  # all grads, padded to DP


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_zero12_send_a_reduce_scatter_and_an_all_gather_of_ddp_volume(comm, strategy):
    c = comm[strategy]
    ddp_bytes = comm["no_shard"]["backward"][0][1]
    assert c["forward"] == [] and c["accumulate"] == []
    assert c["backward"] == [("reduce_scatter", ddp_bytes)]
    assert c["step"] == [("all_gather", ddp_bytes)]


def test_zero3_gathers_each_layer_in_forward_and_again_in_backward(comm):
    c = comm["optim_grads_params"]
    layers = 3
    assert [op for op, _ in c["forward"]] == ["all_gather"] * layers
    assert len(_ops(c["backward"], "all_gather")) == layers
    assert len(_ops(c["backward"], "reduce_scatter")) == layers
    assert sum(_ops(c["forward"], "all_gather")) == sum(_ops(c["backward"], "all_gather"))
    assert c["step"] == []  # the shards are updated in place; the next forward gathers
    # accumulation micro-batch: params are gathered, grads are not reduced
    assert _ops(c["accumulate"], "reduce_scatter") == [] and len(_ops(c["accumulate"], "all_gather")) == 2 * layers


def test_zero3_without_reshard_after_forward_gathers_nothing_in_backward(comm):
    c = comm["zero3-no-reshard"]
    assert [op for op, _ in c["forward"]] == ["all_gather"] * 3
    assert _ops(c["backward"], "all_gather") == []
    assert len(_ops(c["backward"], "reduce_scatter")) == 3
