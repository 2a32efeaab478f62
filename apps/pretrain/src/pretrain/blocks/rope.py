"""Rotary position embeddings: Llama's rotate-half layout, DeepSeek's interleaved pairs; scaling in rope_scaling.py.

Frequencies are computed in float32 as Hugging Face does, so imported models give the same logits.
"""

from __future__ import annotations

import torch

from .rope_scaling import scaled_inv_freq


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``[S, head_dim]`` for the given absolute positions ``[S]`` (or
    ``[S, B, head_dim]`` for positions ``[S, B]``: each sequence its own, as packed documents have).

    Positions are explicit so a context-parallel shard (zigzag or contiguous) gets the angles of
    the tokens it actually holds. ``scaling``: ``[model].rope_scaling`` (transformers' keys; ``{}`` or
    None: plain RoPE), which sets the frequencies and a factor on cos/sin (YaRN's attention factor).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    inv_freq, factor = scaled_inv_freq(inv_freq, head_dim, theta, scaling or {})
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def _over_heads(t: torch.Tensor) -> torch.Tensor:
    """``[S, D]`` -> ``[S, 1, 1, D]``, ``[S, B, D]`` -> ``[S, B, 1, D]``: broadcast against ``[S, B, heads, D]``."""
    return t[:, None, None, :] if t.dim() == 2 else t[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [S, B, heads, head_dim]`` by the per-position angles ``cos/sin [S, head_dim]``
    (or ``[S, B, head_dim]``, positions per sequence)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * _over_heads(cos) + rotated * _over_heads(sin)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs ``(x0, x1), (x2, x3) ...`` rotate together; the result comes out
    de-interleaved (evens then odds), as in Hugging Face. q and k get the same permutation, so
    their dot products are those of the interleaved rotation."""
    half = x.shape[-1] // 2
    c, s = _over_heads(cos)[..., :half], _over_heads(sin)[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def set_shard_rope_tables_(core, device: torch.device, seq_len: int, head_dim: int) -> None:
    """Set ``core.cos``/``core.sin`` (unsaved buffers) on ``device``: RoPE at the positions of the CP
    shard ``core.attn`` holds. On the meta device only their shape: torch would run the computation
    through decompositions that import torch._dynamo (seconds per process) for no values."""
    from par_cp import position_ids

    cp_rank, cp_size = core.attn.cp_rank_and_size
    if torch.device(device).type == "meta":
        core.cos, core.sin = (torch.empty(seq_len // cp_size, head_dim, device=device) for _ in range(2))
        return
    with torch.device(device):
        pos = position_ids(seq_len, cp_rank, cp_size, layout=core.attn.layout)
        core.cos, core.sin = rope_tables(pos, head_dim, core.config.rope_theta, torch.float32, core.config.rope_scaling)


def rope_for(core, docs, dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of a CP shard's tokens: the attention core's own tables (``core.cos``/``core.sin``,
    positions along the whole sequence), or per sequence from ``docs.positions`` (packed documents:
    positions restart at each document)."""
    if docs is None or docs.positions is None:
        return core.cos.to(dtype), core.sin.to(dtype)
    cos, sin = rope_tables(docs.positions, head_dim, core.config.rope_theta, torch.float32, core.config.rope_scaling)
    return cos.to(dtype), sin.to(dtype)
