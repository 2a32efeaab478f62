"""Helpers for the ``gpu``-marked tests: a CUDA run of a package's code against its CPU fp32 result.

``gpu_device()`` is "cuda" when a GPU is visible; without one the test is skipped, unless
``PAR_GPU_TEST_DEVICE=cpu`` asks to run the same test on the CPU (in bf16), which checks the test
itself on machines without a GPU. ``BF16_TOL`` is the tolerance of a bf16 computation against
fp32, as a fraction of the reference's largest magnitude; see ``rel_error``.
"""

from __future__ import annotations

import os

import torch

# bf16 keeps 8 significant bits: each rounding is off by up to 2^-9 = 0.2%. Inputs, weights and
# every matmul output of a small layer stack are rounded (fp32 accumulation inside), so a few
# such errors add up: run in bf16 on the CPU (PAR_GPU_TEST_DEVICE=cpu) the attention and
# expert checks are off by 0.3% to 1.2% of the largest magnitude (1.2%: the MoE up-projection
# grad). 3% leaves room for GPU kernels' accumulation orders without hiding a wrong sum (a
# dropped or doubled term is off by 10% or more here).
BF16_TOL = 3e-2


def gpu_device() -> torch.device:
    """The device a gpu test runs on; skips the test when there is none."""
    import pytest

    wanted = os.environ.get("PAR_GPU_TEST_DEVICE", "cuda")
    if wanted == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (PAR_GPU_TEST_DEVICE=cpu runs these checks on the CPU in bf16)")
    return torch.device(wanted)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32 on the CPU."""
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = BF16_TOL) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_error(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e} against the CPU fp32 result"
