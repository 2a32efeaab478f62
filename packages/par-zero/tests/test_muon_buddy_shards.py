"""buddy_shards=1 with Muon (ZeRO-1, 2 and 3 over dp 2): each rank's buddy range holds the next rank's master,
momentum and AdamW moments bitwise after every step (it steps the momentum itself and applies the owners'
orthogonalized update its own step all-reduced), and training matches one process with torch.optim.Muon on the
matrices and torch.optim.AdamW on the rest."""

import pytest
import torch
import torch.distributed as dist
from par_zero.testing import OPT, STEPS, reference_params, tiny_model, train_parallel

from par_groups import comm
from par_zero import data_parallel

BUCKET_MB = 300 / 2**20
KINDS = ("master", "momentum_buffer", "exp_avg", "exp_avg_sq")


class _TorchMuon:
    """torch.optim.Muon on the matrices (the first group: weight decay), torch.optim.AdamW on the biases."""

    def __init__(self, groups):
        lr, wd = OPT["lr"], OPT["weight_decay"]
        self.opts = [torch.optim.Muon(groups[0]["params"], lr=lr, weight_decay=wd),
                     torch.optim.AdamW(groups[1]["params"], lr=lr, betas=OPT["betas"], eps=OPT["eps"],
                                       weight_decay=0.0, foreach=False)]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


def _flat(optimizer, ranges, kind: str) -> torch.Tensor:
    return torch.cat([optimizer.range_state(b, kind).float() for b in ranges])


def muon_buddies(world: int) -> dict:
    rank = dist.get_rank()
    ref = reference_params(world, optimizer=_TorchMuon)
    out = {}
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        dp = data_parallel(tiny_model(), None, strategy, bucket_mb=BUCKET_MB, buddy_shards=1, optimizer="Muon", **OPT)
        assert len(dp.buffer.buddies) == len(dp.buckets) > 1
        mirrored = []
        for step in range(STEPS):
            train_parallel(dp, world, rank, steps=1, start=step)
            for kind in KINDS:
                own, buddy = _flat(dp.optimizer, dp.buckets, kind), _flat(dp.buddy_optimizer, dp.buffer.buddies, kind)
                owns = torch.empty(world * own.numel())
                comm.all_gather_into_tensor(owns, own.contiguous(), None)
                mirrored.append((step, kind, torch.equal(owns.view(world, -1)[(rank + 1) % world], buddy)))
        out[f"{strategy}-bad"] = [(s, k) for s, k, ok in mirrored if not ok]
        got = dp.full_parameters()
        out[f"{strategy}-error"] = max((got[k] - ref[k]).abs().max().item() for k in ref)
    return out


def test_muon_buddy_shards_mirror_the_next_rank_bitwise_and_train_like_torch_muon(dist_run):
    for r in dist_run(2, muon_buddies, 2, timeout=120):
        for strategy in ("optim", "optim_grads", "optim_grads_params"):
            assert r[f"{strategy}-bad"] == [], (strategy, r)
            assert r[f"{strategy}-error"] <= 2e-6, (strategy, r)
