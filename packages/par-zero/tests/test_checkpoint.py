"""torch.distributed.checkpoint saves our sharded state and loads it under another DP size and strategy."""

import pytest
import torch
import torch.distributed as dist

from par_zero import DataParallel, load_pieces, save_pieces
from par_zero.testing import OPT, hsdp_groups, tiny_model, train_parallel

TARGETS = [  # (name, strategy, dp layout)
    ("dp2-optim", "optim", "dp2"),
    ("dp4-no_shard", "no_shard", "dp4"),
    ("hsdp-outer-optim", "optim_grads_params", "hsdp"),
]


def save_then_reload(path: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    inner, outer = hsdp_groups(2)
    saved = DataParallel(tiny_model(), None, "optim_grads_params", bucket_mb=300 / 2**20, **OPT)
    train_parallel(saved, world, rank, steps=2)
    save_pieces(saved.state_dict(), path)
    want = {k: saved.full_state(k) for k in ("master", "exp_avg", "exp_avg_sq")}
    out = {}
    for name, strategy, layout in TARGETS:
        kw = {}
        group = None
        if layout == "dp2":
            group = inner  # two independent DP=2 replicas of the job, both load the same checkpoint
        elif layout == "hsdp":
            group, kw = inner, dict(outer_group=outer, outer_strategy="optim")
        fresh = DataParallel(tiny_model(), group, strategy, bucket_mb=1.0, **OPT, **kw)
        sd = fresh.state_dict()
        load_pieces(sd, path)
        fresh.load_state_dict(sd)
        err = max((fresh.full_state(k)[n] - want[k][n]).abs().max().item() for k in want for n in want[k])
        # the params the model computes with are the loaded ones
        live = 0.0
        if strategy != "optim_grads_params":  # ZeRO-3 params are only materialised inside forward
            live = max((p.detach() - want["master"][n]).abs().max().item()
                       for n, p in fresh.module.named_parameters() if p.requires_grad)
        out[name] = (err, live, fresh.step_count)
    return out


def test_checkpoint_loads_under_another_dp_size_and_strategy(dist_run, tmp_path):
    results = dist_run(4, save_then_reload, str(tmp_path / "ckpt"), timeout=600)
    for per_rank in results:
        for name, (err, live, step) in per_rank.items():
            assert err == 0.0 and live == 0.0 and step == 2, (name, err, live, step)
