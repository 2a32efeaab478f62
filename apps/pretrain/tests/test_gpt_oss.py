"""gpt-oss's cheap checks (its HF and layout proofs: tests/test_hf_families.py, tests/test_layouts_gpt_oss.py):
the sink applied to a fused kernel's output and log-sum-exp (the flash-attn path's math, here with torch's
fused CPU kernel) equals transformers' masked softmax with the sink, forward and backward, windowed or not;
the CUDA path hands flash-attn (stubbed) the masked path's window; FP8 reaches the biased experts;
`plan gpt-oss-120b` gives the released model's 116.8B parameters, 5.1B active; a [model] gpt-oss cannot
run is one error line."""

import json

import pytest
import torch
from typer.testing import CliRunner

from one_error_line import assert_one_error_line
from pretrain.cli import app
from pretrain.models.gpt_oss import kernel as gpt_oss_kernel
from pretrain.models.gpt_oss.attention import window_of
from pretrain.models.gpt_oss.kernel import SinkAttention, cpu_flash_kernels, masked_sink_attention, sink_attention


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


class FlashStub:
    """flash-attn 2.8's (the locked version's) private forward and backward, in torch on the CPU, batch-first
    ``[B, S, H, D]``, lse ``[B, H, S]``, GQA native. Its window convention: query i sees keys
    ``[i - window_size_left, i + window_size_right]`` (-1: unbounded), and none after i when causal. The
    backward recomputes the probabilities from the lse it is given, as flash-attn does. ``calls``: each
    call's (entry, causal, scale, left, right)."""

    def __init__(self):
        self.calls = []

    def _probs(self, q, k, scale, causal, left, right, lse=None):
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
        seen = (j <= i if causal else j >= 0) & ((j >= i - left) if left >= 0 else True) & \
            ((j <= i + right) if right >= 0 else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(scores, -1) if lse is None else lse
        return torch.exp(scores - lse[..., None]), lse

    def _flash_attn_forward(self, q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, return_softmax):
        self.calls.append(("forward", causal, softmax_scale, window_size_left, window_size_right))
        p, lse = self._probs(q, k, softmax_scale, causal, window_size_left, window_size_right)
        out = torch.einsum("bhst,bthd->bshd", p, v.repeat_interleave(q.shape[2] // v.shape[2], dim=2))
        return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def _flash_attn_backward(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        self.calls.append(("backward", causal, softmax_scale, window_size_left, window_size_right))
        rep = q.shape[2] // k.shape[2]
        p, _ = self._probs(q, k, softmax_scale, causal, window_size_left, window_size_right, softmax_lse)
        kr, vr = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        dp = torch.einsum("bshd,bthd->bhst", dout, vr)
        ds = p * (dp - (dout * out).sum(-1).transpose(1, 2)[..., None])
        dq.copy_(torch.einsum("bhst,bthd->bshd", ds, kr) * softmax_scale)
        dk.copy_((torch.einsum("bhst,bshd->bthd", ds, q) * softmax_scale).unflatten(2, (-1, rep)).sum(3))
        dv.copy_(torch.einsum("bhst,bshd->bthd", p, dout).unflatten(2, (-1, rep)).sum(3))
        return torch.empty(0)


@pytest.mark.parametrize("layer", [0, 1])
def test_flash_path_gets_the_masked_paths_window_and_sinks(monkeypatch, layer):
    """The CUDA path, with flash-attn stubbed (no GPU here): par-cp's choice picks flash-attn for a CUDA bf16
    query; a sliding layer passes flash-attn the window (127, 0), which is its convention for the 128 keys
    ending at the query (transformers' ``sliding_window = 128``, the masked path's ``ahead < 128``), a full
    layer (-1, 0); the sinks applied to its output and lse give the masked path's attention, forward and
    backward, on 160 tokens (past the window)."""
    from types import SimpleNamespace

    from par_cp.kernels import dense

    stub = FlashStub()
    monkeypatch.setattr(dense, "_flash", lambda: stub)
    assert dense.dense_kernel(SimpleNamespace(dtype=torch.bfloat16, is_cuda=True), "auto", on_cpu=True) == "flash"
    monkeypatch.setattr(gpt_oss_kernel, "_flash", lambda: stub)
    monkeypatch.setattr(gpt_oss_kernel, "dense_kernel", lambda q, backend, on_cpu=False: "flash")  # a CPU tensor here
    gen = torch.Generator().manual_seed(1)
    s, b, h, kv, d, window, scale = 160, 2, 4, 2, 16, window_of(layer), 0.25
    q, k, v = (torch.randn(s, b, n, d, generator=gen, requires_grad=True) for n in (h, kv, kv))
    sinks = torch.randn(h, generator=gen, requires_grad=True)
    grad, pos = torch.randn(s, b, h, d, generator=gen), torch.arange(s)
    flash = sink_attention(q, k, v, sinks, scale, window, pos, pos)
    masked = masked_sink_attention(q, k, v, sinks, scale, window, pos, pos)
    span = (127, 0) if layer == 0 else (-1, 0)
    for a, e in zip(torch.autograd.grad((flash * grad).sum(), (q, k, v, sinks)),
                    torch.autograd.grad((masked * grad).sum(), (q, k, v, sinks))):
        assert (a - e).abs().max() <= 1e-5 * e.abs().max()
    assert (flash - masked).abs().max() <= 1e-5 * masked.abs().max()
    assert stub.calls == [("forward", True, scale, *span), ("backward", True, scale, *span)]


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


@pytest.mark.parametrize("attention", ["gqa", "gpt_oss"])
def test_experts_keep_the_rows_their_family_declares(attention):
    """What a routed pair's expert activation keeps for backward is what the planner counts
    (``Family.expert_act_widths`` F-wide rows: par-moe's SwiGLU 4, gpt-oss's clamped SwiGLU 7), and under
    ``moe_act`` recomputation gate, up and the product w_down reads (3)."""
    from par_moe.experts import GroupedSwiGLU
    from pretrain.models import family_of
    from pretrain.models.gpt_oss.moe import BiasedClampedExperts

    rows, hidden, ffn = 24, 48, 80
    kept = []
    for recompute in (False, True):
        torch.manual_seed(0)
        experts = BiasedClampedExperts(4, hidden, ffn, ((0, 1), (0, 1))) if attention == "gpt_oss" else \
            GroupedSwiGLU(4, hidden, ffn)
        experts.recompute_act = recompute
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.shape  # one entry a storage, however often saved
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            experts(torch.randn(rows, hidden, requires_grad=True), torch.tensor([6, 6, 0, 12]))
        kept.append(sum(shape == (rows, ffn) for shape in saved.values()))
    assert kept == [family_of(type("M", (), {"attention": attention})()).expert_act_widths, 3]
