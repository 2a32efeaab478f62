"""``gathered_as``: a ZeRO-3 param gathered by its own function (par_tp.fp8's FP8 parameter gather) gets a
bucket of its own; its unit calls the function on the whole rows this rank holds, publishes what it returns
as ``param.zero3_gathered`` for the unit's forward and backward, and releases it with the unit; the param's
values are never gathered. Other strategies, and a param whose rows do not divide over the ranks, are refused."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from par_groups import comm
from par_zero import DataParallel


class _UsesGathered(nn.Module):
    """``x @ w^T`` with ``w`` the published gathered weight; the weight's grad is computed without its values."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(24.0).view(6, 4) / 10)
        self.seen = []

    def forward(self, x):
        w = self.weight.zero3_gathered
        self.seen.append(w.clone())
        return _Straight.apply(x, self.weight, w)


class _Straight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gathered):
        ctx.save_for_backward(x, gathered)
        return x @ gathered.t()

    @staticmethod
    def backward(ctx, dy):
        x, gathered = ctx.saved_tensors
        return dy @ gathered, dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]), None


def _gather(shard, group):
    out = shard.new_empty(shard.shape[0] * dist.get_world_size(group), *shard.shape[1:])
    comm.all_gather_into_tensor(out, shard.contiguous(), group)
    return out * 2  # another form than the values: what the module reads is the function's


def gathered_job():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _UsesGathered())
    full = model[1].weight.detach().clone()
    shards = []
    dp = DataParallel(model, dist.group.WORLD, "optim_grads_params", lr=0.0,
                      gathered_as={model[1].weight: lambda s, g: shards.append(s.clone()) or _gather(s, g)})
    x = torch.randn(3, 4)
    dp(x).sum().backward()
    released = model[1].weight.zero3_gathered is None
    bucket = next(b for b in dp.buckets if b.gather_as is not None)
    refused = []
    m = _UsesGathered()
    try:
        DataParallel(m, dist.group.WORLD, "optim_grads", gathered_as={m.weight: _gather})
    except ValueError as e:
        refused.append(str(e))
    odd = nn.Linear(4, 3, bias=False)  # 3 rows over 2 ranks
    try:
        DataParallel(odd, dist.group.WORLD, "optim_grads_params", gathered_as={odd.weight: _gather})
    except ValueError as e:
        refused.append(str(e))
    rank = dist.get_rank()
    return {"seen": [torch.equal(w, full * 2) for w in model[1].seen], "released": released,
            "own_bucket": bucket.params == [model[1].weight], "rows": [torch.equal(s, full.chunk(2)[rank]) for s in shards],
            "refused": refused}


def test_gathered_as_publishes_the_functions_result_and_releases_it(dist_run):
    for out in dist_run(2, gathered_job, timeout=120):
        assert out["seen"] == [True] and out["released"] and out["own_bucket"], out
        assert out["rows"] and all(out["rows"]), out  # this rank's rows of the weight, once per gather
        assert len(out["refused"]) == 2 and "'optim_grads_params'" in out["refused"][0], out["refused"]
        assert "3 rows divide over the 2 sharding ranks" in out["refused"][1], out["refused"]
