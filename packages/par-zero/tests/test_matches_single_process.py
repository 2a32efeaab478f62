"""Every strategy trains exactly like one process: 5 AdamW steps, clipping, 2-step accumulation.

The model has 187 trainable params (divides no DP size, so buckets are padded) and one frozen
bias; buckets are ~300 bytes so there are several. Each rank computes the single-process
reference itself, independently of the code under test (torch.optim.AdamW, torch clipping).
"""

import pytest
import torch
import torch.distributed as dist
from par_zero.testing import OPT, STEPS, hsdp_groups, reference_params, tiny_model, train_parallel

from par_zero import data_parallel

BUCKET_MB = 300 / 2**20
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params", "torch_fsdp2"]
HSDP = [("optim", "no_shard"), ("optim_grads", "no_shard"), ("optim_grads_params", "no_shard"),
        ("optim_grads_params", "optim"), ("torch_fsdp2", "no_shard")]


def _max_err(dp, ref) -> float:
    got = dp.full_parameters()
    assert set(got) == set(ref)
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def train_every_layout(world: int) -> dict[str, float]:
    rank = dist.get_rank()
    ref_norms: list[float] = []
    ref = reference_params(world, ref_norms)
    errors = {}

    def run(name, strategy, group=None, sync_every_backward=False, **kw):
        dp = data_parallel(tiny_model(kw.pop("expert", False)), group, strategy, bucket_mb=BUCKET_MB, **OPT, **kw)
        norms = train_parallel(dp, world, rank, sync_every_backward=sync_every_backward)
        norm_err = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
        errors[name] = max(_max_err(dp, ref), norm_err)  # params and every step's grad norm

    for s in STRATEGIES:
        run(s, s)
    if world == 4:
        inner, outer = hsdp_groups(2)
        for s, o in HSDP:
            run(f"hsdp-{s}-outer-{o}", s, inner, outer_group=outer, outer_strategy=o)
    else:
        run("optim_grads_params-no-reshard", "optim_grads_params", reshard_after_forward=False)
        run("optim_grads_params-all-gather-group", "optim_grads_params", all_gather_group=dist.new_group(list(range(world))))
        run("optim-fp32-reduce", "optim", reduce_dtype=torch.float32)
        for s in ("optim_grads", "optim_grads_params"):  # the accelerator default (CPU: overlap off)
            run(f"{s}-overlap-comm", s, overlap_comm=True)
        for s in ("no_shard", "optim_grads", "optim_grads_params"):
            run(f"{s}-expert-group", s, expert=True, expert_dp_group=dist.new_group(list(range(world))))
        # two synced backwards in one step: each reduces; ZeRO-1 then restores "sum of
        # contributions" in its persistent buffer (Bucket.accumulate), ZeRO-2 (and 3: the same
        # Bucket._finish) adds the second reduction's shard to the first's
        for s in ("optim", "optim_grads"):
            run(f"{s}-sync-every-backward", s, sync_every_backward=True)
    return errors


def train_bf16(world: int) -> dict[str, float]:
    """bf16 params and grads with fp32 masters: the largest param error against the fp32 reference,
    and (``"one step"``) how far the reference's last optimizer step moved its params."""
    rank = dist.get_rank()
    ref = reference_params(world)
    before_last = reference_params(world, steps=STEPS - 1)
    out = {"one step": max((ref[k] - before_last[k]).abs().max().item() for k in ref)}
    for s in ("no_shard", "optim", "optim_grads_params"):
        for rd in (None, torch.float32):
            dp = data_parallel(tiny_model(), None, s, bucket_mb=BUCKET_MB, param_dtype=torch.bfloat16, reduce_dtype=rd, **OPT)
            train_parallel(dp, world, rank)
            out[f"{s}-reduce-{rd}"] = _max_err(dp, ref)
    return out


@pytest.fixture(scope="module")
def errors(dist_run):
    return {w: dist_run(w, train_every_layout, w, timeout=600) for w in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_matches_single_process_training(errors, world):
    per_rank = errors[world]
    names = set(per_rank[0])
    assert set(STRATEGIES) <= names
    if world == 4:
        assert sum(n.startswith("hsdp-") for n in names) == len(HSDP)
    bad = {n: max(r[n] for r in per_rank) for n in names if max(r[n] for r in per_rank) > 2e-6}
    assert not bad, f"params differ from the single-process run: {bad}"


# Measured (2 ranks, 5 steps at lr 1e-2): bf16 params are off by at most 1.35e-3 (fp32 reduce:
# 1.27e-3), while one AdamW step moves the params by 1.0e-2 (~lr). 0.3 of one step is 2.2x the
# measured error, and a run missing its last optimizer step (off by that whole step) fails.
BF16_STEP_FRACTION = 0.3


def test_bf16_params_with_fp32_master_stay_close_to_fp32(dist_run):
    per_rank = dist_run(2, train_bf16, 2, timeout=600)
    errors = dict(per_rank[0])
    one_step = errors.pop("one step")
    assert one_step > 5e-3, one_step  # the bound below is relative to a real update
    for name, err in errors.items():
        print(f"bf16 {name}: {err:.2e} = {err / one_step:.2f} of one step")
        assert err <= BF16_STEP_FRACTION * one_step, (name, err, one_step)
