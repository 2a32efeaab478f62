"""Every strategy trains exactly like one process: 5 AdamW steps, clipping, 2-step accumulation.

The model has 187 trainable params (divides no DP size, so buckets are padded) and one frozen
bias; buckets are ~300 bytes so there are several. Each rank computes the single-process
reference itself, independently of the code under test (torch.optim.AdamW, torch clipping).
"""

import pytest
import torch
import torch.distributed as dist
from par_zero.testing import OPT, hsdp_groups, reference_params, tiny_model, train_parallel

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

    def run(name, strategy, group=None, **kw):
        dp = data_parallel(tiny_model(kw.pop("expert", False)), group, strategy, bucket_mb=BUCKET_MB, **OPT, **kw)
        norms = train_parallel(dp, world, rank)
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
    return errors


def train_bf16(world: int) -> dict[str, float]:
    """bf16 params and grads with fp32 masters: close to the fp32 reference (bf16 tolerance)."""
    rank = dist.get_rank()
    ref = reference_params(world)
    out = {}
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


def test_bf16_params_with_fp32_master_stay_close_to_fp32(dist_run):
    per_rank = dist_run(2, train_bf16, 2, timeout=600)
    for name, err in per_rank[0].items():
        assert err < 2e-2, (name, err)
