"""gpt-oss's cheap checks (its HF and layout proofs: tests/test_hf_families.py, tests/test_layouts_gpt_oss.py):
the sink applied to a fused kernel's output and log-sum-exp (the flash-attn path's math, here with torch's
fused CPU kernel) equals transformers' masked softmax with the sink, forward and backward, windowed or not;
`plan gpt-oss-120b` gives the released model's 116.8B parameters, 5.1B active; a [model] gpt-oss cannot
run is one error line."""

import json

import pytest
import torch
from typer.testing import CliRunner

from one_error_line import assert_one_error_line
from pretrain.cli import app
from pretrain.models.gpt_oss.kernel import SinkAttention, cpu_flash_kernels, masked_sink_attention


@pytest.mark.parametrize("window", [0, 128])
def test_sink_on_a_fused_kernel_equals_the_masked_softmax(window):
    gen = torch.Generator().manual_seed(0)
    s, b, h, kv, d = 160, 2, 4, 2, 16
    q, k, v = (torch.randn(s, b, n, d, generator=gen, requires_grad=True) for n in (h, kv, kv))
    sinks = torch.randn(h, generator=gen, requires_grad=True)
    grad, pos = torch.randn(s, b, h, d, generator=gen), torch.arange(s)
    fused = SinkAttention.apply(*(t.transpose(0, 1) for t in (q, k, v)), sinks,
                                cpu_flash_kernels(0.25, window, s, q.device)).transpose(0, 1)
    masked = masked_sink_attention(q, k, v, sinks, 0.25, window, pos, pos)
    for a, e in zip(torch.autograd.grad((fused * grad).sum(), (q, k, v, sinks)),
                    torch.autograd.grad((masked * grad).sum(), (q, k, v, sinks))):
        assert (a - e).abs().max() <= 1e-5 * e.abs().max()
    assert (fused - masked).abs().max() <= 1e-5 * masked.abs().max()


def test_plan_gives_the_released_parameter_counts():
    res = CliRunner().invoke(app, ["plan", "gpt-oss-120b", "--world", "256", "--json"])
    assert res.exit_code == 0, res.output
    params = json.loads(res.stdout)["params"]
    assert round(params["total"] / 1e9, 1) == 116.8 and round(params["active"] / 1e9, 1) == 5.1


@pytest.mark.parametrize("change, named", [("model.num_experts=0", "experts in every layer"),
                                           ("model.shared_experts=1", "no shared_experts"),
                                           ("model.mtp_depth=1", "mtp_depth=1"),
                                           ("parallel.tp=16", "must divide [model].kv_heads=8"),
                                           ("parallel.etp=2", "parallel.etp=1"),
                                           ("data.document_mask=true", "document_mask=true")])
def test_a_model_gpt_oss_cannot_run_is_one_error_line(change, named):
    res = CliRunner().invoke(app, ["plan", "gpt-oss-120b", "--world", "256", "--set", change])
    assert_one_error_line(res, change.split("=")[0].split(".")[1], named)


def test_fp8_experts_quantize_their_gemms_and_keep_the_biases():
    """``[train].fp8`` gives every expert GEMM par's FP8 kernel, as par-moe's experts (the wiring sets
    ``grouped_kernels`` on any ``GroupedSwiGLU``): each expert's three weights are quantized, and the layer
    stays the biased, clamped SwiGLU (within FP8's rounding of the high-precision one, far below the biases'
    share of it)."""
    from par_tp.fp8 import FP8GroupedKernel, recording
    from pretrain.models.gpt_oss.moe import BiasedClampedExperts

    torch.manual_seed(0)
    experts = BiasedClampedExperts(4, 64, 32, ((0, 1), (0, 1)))
    with torch.no_grad():
        for b in (experts.b_gate, experts.b_up, experts.b_down):
            b.normal_()
    tokens, counts = torch.randn(24, 64), torch.tensor([9, 3, 0, 12])
    exact = experts(tokens, counts)
    experts.grouped_kernels = tuple(FP8GroupedKernel("rowwise") for _ in range(3))
    with recording() as taps:
        fp8 = experts(tokens, counts)
    assert sorted(what for what, _ in taps if what.startswith("forward w[")) == sorted(
        f"forward w[{g}]" for g in (0, 1, 3) for _ in range(3))  # expert 2 has no tokens
    down_bias = experts.b_down.detach().repeat_interleave(counts, 0)  # the rows are sorted by expert
    err = (fp8 - exact).norm()
    assert err <= 0.1 * exact.norm() and err <= 0.25 * down_bias.norm(), (err, exact.norm(), down_bias.norm())
