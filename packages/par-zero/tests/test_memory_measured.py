"""Bytes each rank really holds in params + grads + optimizer state match the memory model (5%)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from par_zero import data_parallel, model_state_for_params
from par_zero.testing import hsdp_groups

WORLD = 4
CASES = [  # (name, strategy, outer strategy or None for no HSDP, param dtype)
    ("no_shard", "no_shard", None, torch.float32),
    ("optim", "optim", None, torch.float32),
    ("optim_grads", "optim_grads", None, torch.float32),
    ("optim_grads_params", "optim_grads_params", None, torch.float32),
    ("optim-bf16", "optim", None, torch.bfloat16),
    ("optim_grads_params-bf16", "optim_grads_params", None, torch.bfloat16),
    ("torch_fsdp2", "torch_fsdp2", None, torch.float32),
    ("hsdp-optim_grads_params", "optim_grads_params", "no_shard", torch.float32),
    ("hsdp-outer-optim", "optim_grads_params", "optim", torch.float32),
    ("hsdp-optim", "optim", "no_shard", torch.float32),
]


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32))


def measure(world: int) -> dict:
    inner, outer = hsdp_groups(2)
    out = {}
    for name, strategy, outer_strategy, dtype in CASES:
        hsdp = outer_strategy is not None
        m = model()
        n = sum(p.numel() for p in m.parameters())
        dp = data_parallel(m, inner if hsdp else None, strategy, param_dtype=dtype, bucket_mb=0.01,
                          outer_group=outer if hsdp else None, outer_strategy=outer_strategy or "no_shard")
        dp(torch.randn(4, 64)).float().pow(2).mean().backward()
        dp.step()  # at rest after the step: optimizer state exists, transient buffers are gone
        d = 2 if hsdp else world
        predicted = model_state_for_params(n, strategy, d, outer=2 if hsdp else 1,
                                           outer_strategy=outer_strategy or "no_shard", param_dtype=dtype)
        measured = dp.model_state_bytes()
        out[name] = (measured["total"], predicted.total)
    return out


@pytest.fixture(scope="module")
def measured(dist_run):
    return dist_run(WORLD, measure, WORLD, timeout=600)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_measured_model_state_matches_memory_model(measured, name):
    for rank_result in measured:
        got, predicted = rank_result[name]
        assert got == pytest.approx(predicted, rel=0.05), (name, got, predicted)
