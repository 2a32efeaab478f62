"""How a sequence is split over CP ranks, and the position ids (for RoPE) of each rank's tokens.

``contiguous``: rank r holds tokens [r*S/cp, (r+1)*S/cp). Fine without a causal mask.
``zigzag``: the sequence is cut into 2*cp chunks and rank r keeps chunks r and 2*cp-1-r, so
under a causal mask every rank has the same amount of work (an early chunk sees few keys, its
mirror sees many).

A rank's shard is described by its *segments*: the global token ranges it holds, in the order
they appear in its local tensor. The attention modes use these to compute masks and to skip
blocks that a causal or document mask hides completely.
"""

from __future__ import annotations

from typing import Sequence

import torch

LAYOUTS = ("zigzag", "contiguous")

Segments = tuple[tuple[int, int], ...]


def _check(seq_len: int, cp_rank: int, cp_size: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size})")
    chunks = 2 * cp_size if layout == "zigzag" else cp_size
    if seq_len % chunks:
        raise ValueError(f"seq_len={seq_len} must be divisible by {chunks} ({layout} layout with cp_size={cp_size})")


def shard_segments(seq_len: int, cp_rank: int, cp_size: int, layout: str = "zigzag") -> Segments:
    """Global token ranges held by ``cp_rank``, in local order."""
    _check(seq_len, cp_rank, cp_size, layout)
    if layout == "contiguous":
        n = seq_len // cp_size
        return ((cp_rank * n, (cp_rank + 1) * n),)
    n = seq_len // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return ((first * n, (first + 1) * n), (second * n, (second + 1) * n))


def segment_indices(segments: Segments, device=None) -> torch.Tensor:
    """The global token index of every local token of a shard."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in segments])


def merge_segments(segments: Sequence[tuple[int, int]]) -> Segments:
    """Sort ranges and fuse neighbours: [(4, 6), (0, 2), (2, 4)] -> ((0, 6),)."""
    out: list[list[int]] = []
    for a, b in sorted(segments):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 0, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` (sequence along ``dim``)."""
    segs = shard_segments(x.shape[dim], cp_rank, cp_size, layout)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in segs], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 0, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from every rank's shard (rank order)."""
    cp_size = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    pieces: list[tuple[int, torch.Tensor]] = []
    for rank, shard in enumerate(shards):
        offset = 0
        for a, b in shard_segments(seq_len, rank, cp_size, layout):
            pieces.append((a, shard.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim=dim)


def position_ids(
    seq_len: int,
    cp_rank: int,
    cp_size: int,
    layout: str = "zigzag",
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE positions of this rank's tokens: global positions, or positions within each document
    when ``cu_seqlens`` (document boundaries of the full sequence) is given."""
    index = segment_indices(shard_segments(seq_len, cp_rank, cp_size, layout))
    if cu_seqlens is None:
        return index
    bounds = torch.as_tensor(list(cu_seqlens) if not torch.is_tensor(cu_seqlens) else cu_seqlens.tolist(), dtype=torch.long)
    doc = torch.searchsorted(bounds, index, right=True) - 1
    return index - bounds[doc]
