"""CUDA: the grouped experts under bf16 autocast (torch's grouped GEMM where the GPU has it)
equal the CPU fp32 experts: output and every weight grad."""

import pytest
import torch

from par_groups.testing.gpu import assert_bf16_close, gpu_device
from par_moe import GroupedSwiGLU, grouped_mm_available

pytestmark = pytest.mark.gpu
E, H, F, N = 8, 128, 256, 512


def run(device: torch.device, bf16: bool):
    torch.manual_seed(0)
    experts = GroupedSwiGLU(E, H, F).to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randn(N, H, generator=g).to(device)
    counts = torch.tensor([100, 0, 37, 91, 64, 8, 112, 100])  # an empty expert, uneven groups
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = experts(tokens, counts)
    out.float().square().mean().backward()
    return [out, experts.w_gate.grad, experts.w_up.grad, experts.w_down.grad]


def test_grouped_experts_bf16_match_cpu_fp32():
    device = gpu_device()
    assert grouped_mm_available(device) or device.type == "cuda", "the CPU has torch's grouped GEMM"
    for got, want, what in zip(run(device, True), run(torch.device("cpu"), False), ("out", "dw_gate", "dw_up", "dw_down")):
        assert_bf16_close(got, want, what)
