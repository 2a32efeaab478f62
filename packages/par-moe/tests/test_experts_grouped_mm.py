"""Both expert paths on the CPU, against a loop of ``F.linear`` per expert (the plain PyTorch
oracle): torch's grouped GEMM (fp32 on the CPU) and the zero-padded ``bmm`` (taken where the rows
are not 16-byte aligned). Outputs and every gradient, with an expert that receives no token and
an expanded output gradient (``y.sum().backward()``, which the grouped GEMM's backward refuses
unless it is made dense)."""

import pytest
import torch
import torch.nn.functional as F

from par_moe import GroupedSwiGLU, grouped_mm_supported


def per_expert_loop(experts: GroupedSwiGLU, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = []
    for e, rows in enumerate(x.split(counts)):
        gate, up = F.linear(rows, experts.w_gate[e]), F.linear(rows, experts.w_up[e])
        out.append(F.linear(F.silu(gate) * up, experts.w_down[e]))
    return torch.cat(out)


def grads(experts: GroupedSwiGLU, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    return torch.autograd.grad(y.sum(), [x, experts.w_gate, experts.w_up, experts.w_down])


@pytest.mark.parametrize("hidden, grouped", [(64, True), (60, False)])
def test_experts_equal_a_loop_over_experts(hidden, grouped):
    torch.manual_seed(0)
    experts = GroupedSwiGLU(4, hidden, 96)
    counts = [5, 0, 30, 1]  # expert 1 receives nothing: its gradients are zero
    x = torch.randn(sum(counts), hidden, requires_grad=True)
    assert grouped_mm_supported(x, experts.w_gate, experts.w_up, experts.w_down) == grouped
    y = experts(x, torch.tensor(counts))
    expected = per_expert_loop(experts, x, counts)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    for ours, oracle in zip(grads(experts, x, y), grads(experts, x, expected)):
        torch.testing.assert_close(ours, oracle, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(grads(experts, x, experts(x, torch.tensor(counts)))[1][1]) == 0


def test_grouped_gemm_on_the_cpu_takes_fp32_and_bf16_but_not_fp64():
    x, w = torch.randn(8, 32), torch.randn(4, 64, 32)
    assert grouped_mm_supported(x, w) and grouped_mm_supported(x.bfloat16(), w.bfloat16())
    assert not grouped_mm_supported(x.double(), w.double())
    assert not grouped_mm_supported(x, w.bfloat16())  # mixed dtypes: the padded bmm
