"""gpt-oss attention on one rank's queries: causal, optionally a sliding window, and a learned sink per head.

A sink is one more logit per head in every query's softmax, with a zero value: the output is plain
attention's scaled by ``exp(lse) / (exp(lse) + exp(sink))``. Two paths behind par-cp's kernel choice
(``dense_kernel``): flash-attn on CUDA, with its own window, the sink applied to its output and
log-sum-exp and its backward given the sink's log-sum-exp (``SinkAttention``); on fake CPU tensors
(``plan --simulate``) the same with torch's fused CPU kernel, so the memory measured is a fused kernel's
as on a GPU; otherwise (real CPU tensors, a shard of queries against gathered keys under ring CP,
``backend = "torch"``) the masked softmax of transformers' eager gpt-oss attention, with every query's
and key's global position: it rounds as transformers does (the fused CPU kernel's blocked softmax
lands about 2e-6 of the largest logit away).
"""

from __future__ import annotations

import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor

from par_cp.kernels.dense import dense_kernel
from par_cp.kernels.flash import _flash


def masked_sink_attention(q, k, v, sinks, scale: float, window: int, q_pos, k_pos) -> torch.Tensor:
    """q ``[Sq, B, Hq, D]``, k/v ``[Sk, B, Hkv, D]``, ``sinks [Hq]``, global positions ``q_pos [Sq]``,
    ``k_pos [Sk]`` (any order) -> ``[Sq, B, Hq, D]``. ``window`` 0: full causal; else a query sees the
    ``window`` keys ending at itself (transformers' sliding window)."""
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    ahead = q_pos[:, None] - k_pos[None, :]
    seen = ahead >= 0
    if window:
        seen = seen & (ahead < window)
    scores = scores.masked_fill(~seen, float("-inf"))
    b, h, sq, _ = scores.shape
    logits = torch.cat([scores, sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("bhst,tbhd->sbhd", probs.to(v.dtype), v)


def _matched(fn, **kwargs):
    """``fn`` called with the keywords it takes (flash-attn's private entry points differ by version)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a torch custom op in newer flash-attn
        params = inspect.signature(fn._init_fn).parameters
    left, right = kwargs.pop("window")
    kwargs |= {"window_size": (left, right)} if "window_size" in params else {"window_size_left": left,
                                                                                  "window_size_right": right}
    defaults = {"softcap": 0.0, "alibi_slopes": None, "return_softmax": False, "deterministic": False, "rng_state": None}
    return fn(**{n: v for n, v in (defaults | kwargs).items() if n in params})


def flash_kernels(scale: float, window: int):
    """(forward, backward) of flash-attn, batch-first ``[B, S, H, D]``, lse ``[B, H, S]``."""
    fai, span = _flash(), (window - 1 if window else -1, 0)

    def forward(q, k, v):
        res = _matched(fai._flash_attn_forward, q=q, k=k, v=v, dropout_p=0.0, softmax_scale=scale, causal=True,
                       window=span)
        return res[0], res[1]

    def backward(dout, q, k, v, out, lse):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _matched(fai._flash_attn_backward, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                 dropout_p=0.0, softmax_scale=scale, causal=True, window=span)
        return dq, dk, dv

    return forward, backward


def cpu_flash_kernels(scale: float, window: int, seq: int, device):
    """(forward, backward) of torch's fused CPU attention (the kernel SDPA runs on the CPU, returning its
    log-sum-exp), batch-first as :func:`flash_kernels`; the window as an additive mask (0 or -inf). GQA
    native, as flash-attn's (query head i reads KV head i // (Hq / Hkv)): no repeated KV heads."""
    ops = torch.ops.aten
    masks = {}

    def mask_for(dtype):
        if window and dtype not in masks:
            ahead = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
            seen = (ahead >= 0) & (ahead < window)
            masks[dtype] = torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(~seen, float("-inf"))
        return masks.get(dtype)

    def heads_first(q, k, v):
        return [t.transpose(1, 2) for t in (q, k, v)]

    def forward(q, k, v):
        qh, kh, vh = heads_first(q, k, v)
        mask = mask_for(q.dtype)
        out, lse = ops._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, mask is None, attn_mask=mask,
                                                                   scale=scale)
        return out.transpose(1, 2), lse

    def backward(dout, q, k, v, out, lse):
        qh, kh, vh = heads_first(q, k, v)
        mask = mask_for(q.dtype)
        dq, dk, dv = ops._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), qh, kh, vh, out.transpose(1, 2), lse, 0.0, mask is None, attn_mask=mask, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    return forward, backward


class SinkAttention(torch.autograd.Function):
    """Attention through ``kernels = (forward, backward)`` (batch-first, as :func:`flash_kernels`), then the sinks.

    Forward: ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``. That is attention over
    the keys and the sink with probabilities ``exp(s - lse')``, so the kernel's own backward given
    ``out'`` and ``lse'`` returns its dq, dk, dv; the sink's gradient is ``-sum exp(sink - lse') * delta``
    with ``delta = rowsum(dout * out')``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernels):
        out, lse = kernels[0](q, k, v)
        lse_sink = torch.logaddexp(lse.float(), sinks.float()[None, :, None])
        out = (out.float() * torch.exp(lse.float() - lse_sink).transpose(1, 2)[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_sink, sinks)
        ctx.backward_kernel = kernels[1]
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.backward_kernel(dout, q, k, v, out, lse)
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # [B, H, S]
        dsinks = -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum((0, 2))
        return dq, dk, dv, dsinks.to(sinks.dtype), None


def sink_attention(q, k, v, sinks, scale: float, window: int, q_pos, k_pos, backend: str = "auto") -> torch.Tensor:
    """The attention of :func:`masked_sink_attention`; flash-attn's where par-cp would run it and the
    positions are the whole sequence in order (one rank's, or all of them after Ulysses' all-to-all)."""
    whole = q_pos.shape == k_pos.shape  # the callers pass one in-order sequence for both, or a shard of it
    kernel = dense_kernel(q, backend, on_cpu=True) if whole else None
    if kernel == "flash":
        kernels = flash_kernels(scale, window)
    elif kernel == "sdpa" and isinstance(q, FakeTensor):  # plan --simulate: a fused kernel's memory, as a GPU's
        # fake tensors have no values for a window to change, and flash-attn keeps no mask for it: none of
        # the S x S masks a CPU window needs (one a layer and micro-batch, alive until its backward)
        kernels = cpu_flash_kernels(scale, 0, q.shape[0], q.device)
    else:
        return masked_sink_attention(q, k, v, sinks, scale, window, q_pos, k_pos)
    bf = [t.transpose(0, 1).contiguous() for t in (q, k, v)]
    return SinkAttention.apply(*bf, sinks, kernels).transpose(0, 1)
