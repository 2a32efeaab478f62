"""CUDA: par's FP8 linear quantizes the CPU's bytes and computes the CPU's result.

Each recipe's six GEMM operands (data and scales, ``.view(torch.uint8)``) on the GPU are bitwise the CPU's
(the quantization is elementwise fp32 arithmetic and a saturated cast); the output and both gradients
agree to fp32 summation order (tensorwise and rowwise on the GPU's ``torch._scaled_mm``, the tiles
emulated). tools/gpu/check.sh runs it with the other ``-m gpu`` tests.
"""

import pytest
import torch

from par_groups.testing.gpu import gpu_device, rel_error
from par_tp.fp8 import RECIPES, fp8_linear, recording

pytestmark = pytest.mark.gpu
S, K, N = 256, 256, 384


def _run(device, recipe):
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(S, K, generator=g), torch.randn(N, K, generator=g) * 0.05, torch.randn(S, N, generator=g)
    x, w = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    with recording() as taps:
        y = fp8_linear(x, w, recipe)
        (y * dy.to(device)).sum().backward()
    return y, x.grad, w.grad, taps


def _u8(t):
    return t.detach().cpu().contiguous().reshape(t.shape or (1,)).view(torch.uint8)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_linear_on_gpu_matches_cpu(recipe):
    device = gpu_device()
    *gpu, gpu_taps = _run(device, recipe)
    *cpu, cpu_taps = _run("cpu", recipe)
    for (what, a), (_, b) in zip(gpu_taps, cpu_taps):
        assert torch.equal(_u8(a.data), _u8(b.data)) and torch.equal(_u8(a.scale), _u8(b.scale)), (recipe, what)
    for name, a, b in zip(("y", "dx", "dw"), gpu, cpu):
        assert rel_error(a, b) <= 1e-5, (recipe, name, rel_error(a, b))
