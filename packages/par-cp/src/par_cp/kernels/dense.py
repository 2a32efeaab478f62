"""Attention of a whole unsharded sequence (cp = 1, one document) on a GPU: one fused call.

Without context parallelism there is nothing to merge, so the LSE plumbing of the block kernels
is not needed: the library's own autograd does the backward. flash-attn's ``flash_attn_func``
when installed, else torch's SDPA (on CUDA its built-in flash kernel). CPU tensors keep the
block path (its kernels are the ones CI checks), so this returns None for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .flash import _flash


def dense_kernel(q: torch.Tensor, backend: str, on_cpu: bool = False) -> str | None:
    """'flash', 'sdpa' or None (use the block path) for these tensors and the requested backend;
    ``on_cpu``: torch's SDPA for CPU tensors too (else they keep the block path)."""
    if backend == "torch" or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    if not q.is_cuda:
        return "sdpa" if on_cpu and q.device.type == "cpu" and backend in ("auto", "sdpa") else None
    if backend in ("auto", "flash") and q.dtype != torch.float32 and _flash() is not None:
        return "flash"
    return "sdpa" if backend in ("auto", "sdpa") else None


def sdpa_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """q ``[S, B, Hq, D]``, k/v ``[S, B, Hkv, D]`` -> ``[S, B, Hq, D]`` through torch's SDPA (GQA native)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, H, S, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.permute(2, 0, 1, 3)


def flash_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """The same through flash-attn (batch-first ``[B, S, H, D]``; GQA native)."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out = _flash().flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    return out.transpose(0, 1)


def dense_attention(q, k, v, causal: bool, scale: float, backend: str = "auto", on_cpu: bool = False) -> torch.Tensor | None:
    kernel = dense_kernel(q, backend, on_cpu)
    if kernel is None:
        return None
    return (flash_attention if kernel == "flash" else sdpa_attention)(q, k, v, causal, scale)
