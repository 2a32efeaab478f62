"""buddy_shards=1 (ZeRO-1, and ZeRO-2 in fp32): training matches one process, and each rank's buddy range (the next
rank's shard) holds that rank's master and AdamW moments bitwise after every step, fp32 params and bf16 ones (own
masters)."""

import pytest
import torch
import torch.distributed as dist
from par_zero.testing import OPT, STEPS, reference_params, tiny_model, train_parallel

from par_groups import comm
from par_zero import data_parallel

BUCKET_MB = 300 / 2**20


def _flat(optimizer, ranges, kind: str) -> torch.Tensor:
    """``kind`` over ``ranges`` (a rank's buckets or its buddy ranges: each one shard long, padding included)."""
    return torch.cat([optimizer.range_state(b, kind).float() for b in ranges])


def train_with_buddies(world: int) -> dict:
    rank = dist.get_rank()
    ref = reference_params(world)
    out = {}
    for strategy, dtype in (("optim", torch.float32), ("optim", torch.bfloat16), ("optim_grads", torch.float32)):
        dtype_key = dtype if strategy == "optim" else f"{strategy}-{dtype}"
        dp = data_parallel(tiny_model(), None, strategy, bucket_mb=BUCKET_MB, param_dtype=dtype, buddy_shards=1, **OPT)
        assert len(dp.buffer.buddies) == len(dp.buckets) > 1
        train_parallel(dp, world, rank)
        got = dp.full_parameters()
        out[f"{dtype_key}-error"] = max((got[k] - ref[k]).abs().max().item() for k in ref)
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            own, buddy = _flat(dp.optimizer, dp.buckets, kind), _flat(dp.buddy_optimizer, dp.buffer.buddies, kind)
            assert own.numel() == buddy.numel() > 0
            owns = torch.empty(world * own.numel())
            comm.all_gather_into_tensor(owns, own.contiguous(), None)
            nxt = owns.view(world, -1)[(rank + 1) % world]
            out[f"{dtype_key}-{kind}-bitwise"] = torch.equal(nxt, buddy)
        held = dp.model_state_bytes()["optim"]
        plain = data_parallel(tiny_model(), None, strategy, bucket_mb=BUCKET_MB, param_dtype=dtype, **OPT)
        train_parallel(plain, world, rank, steps=1)
        out[f"{dtype_key}-optim-bytes"] = (held, plain.model_state_bytes()["optim"])
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_buddy_shards_train_like_one_process_and_mirror_the_next_rank_bitwise(dist_run, world):
    for r in dist_run(world, train_with_buddies, world, timeout=300):
        assert r["torch.float32-error"] <= 2e-6 and r["optim_grads-torch.float32-error"] <= 2e-6, r
        assert r["torch.bfloat16-error"] <= 5e-3, r  # bf16 params: the plain ZeRO-1 bound (test_matches_single_process)
        assert all(v for k, v in r.items() if k.endswith("bitwise")), r
        for dtype in ("torch.float32", "torch.bfloat16", "optim_grads-torch.float32"):  # a second shard of moments
            # (and of masters in bf16)
            held, plain = r[f"{dtype}-optim-bytes"]
            assert held == 2 * plain, (dtype, held, plain)


def train_zero3_with_buddies(world: int) -> dict:
    """ZeRO-3 with buddies beside plain ZeRO-3, step by step: the same bits on each rank's own range, its buddy
    range the next rank's own, the curve single-process AdamW's."""
    rank = dist.get_rank()
    norms: list[float] = []
    ref = reference_params(world, norms)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        dp = data_parallel(tiny_model(), None, "optim_grads_params", param_dtype=dtype, buddy_shards=1, **OPT)
        plain = data_parallel(tiny_model(), None, "optim_grads_params", param_dtype=dtype, **OPT)
        assert len(dp.buffer.buddies) == len(dp.buckets) > 1
        same, mirrored, got_norms = [], [], []
        for step in range(STEPS):
            got_norms += train_parallel(dp, world, rank, steps=1, start=step)
            train_parallel(plain, world, rank, steps=1, start=step)
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                own, buddy = _flat(dp.optimizer, dp.buckets, kind), _flat(dp.buddy_optimizer, dp.buffer.buddies, kind)
                same.append(torch.equal(own, _flat(plain.optimizer, plain.buckets, kind)))
                owns = torch.empty(world * own.numel())
                comm.all_gather_into_tensor(owns, own.contiguous(), None)
                mirrored.append(torch.equal(owns.view(world, -1)[(rank + 1) % world], buddy))
            shards = [b.param_shard for b in dp.buckets]  # the params at rest: the owners' masters
            same.append(all(torch.equal(a, b.param_shard) for a, b in zip(shards, plain.buckets)))
        got = dp.full_parameters()
        out[f"{dtype}-error"] = max((got[k] - ref[k]).abs().max().item() for k in ref)
        out[f"{dtype}-norms"] = max(abs(a - b) / b for a, b in zip(got_norms, norms))
        out[f"{dtype}-same"], out[f"{dtype}-mirrored"] = all(same), all(mirrored)
        out[f"{dtype}-bytes"] = (dp.model_state_bytes(), plain.model_state_bytes())
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_zero3_buddy_shards_step_bitwise_as_plain_zero3_and_mirror_the_next_rank_each_step(dist_run, world):
    """ZeRO-3 (par's own) with buddies: every step the rank's own state and param shard are plain ZeRO-3's bits,
    its buddy range (master, moments) the next rank's own bitwise, and the run single-process AdamW's."""
    for r in dist_run(world, train_zero3_with_buddies, world, timeout=300):
        assert r["torch.float32-error"] <= 2e-6 and r["torch.bfloat16-error"] <= 5e-3, r
        assert r["torch.float32-norms"] <= 1e-5, r
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert r[f"{dtype}-same"] and r[f"{dtype}-mirrored"], (dtype, r)
            held, plain = r[f"{dtype}-bytes"]
            assert held["grads"] == 2 * plain["grads"] and held["optim"] == 2 * plain["optim"], (dtype, held, plain)
            # fp32: the buddy's master is the next rank's param shard; bf16: its master (optimizer state) carries it
            assert held["params"] == (2 if dtype == "torch.float32" else 1) * plain["params"], (dtype, held, plain)
