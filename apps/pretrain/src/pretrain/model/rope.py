"""Rotary position embeddings (Llama / Hugging Face convention: rotate the two halves)."""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``[S, head_dim]`` for the given absolute positions ``[S]``.

    Positions are explicit so a context-parallel shard (zigzag or contiguous) gets the angles of
    the tokens it actually holds.
    """
    # float32 as Hugging Face computes it, so imported models give the same logits.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [S, B, heads, head_dim]`` by the per-position angles ``cos/sin [S, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, None, :] + rotated * sin[:, None, None, :]
