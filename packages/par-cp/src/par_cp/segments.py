"""Attention between a rank's query shard and one key/value shard, both given as segments.

A shard is a list of global token ranges laid end to end in the local tensor (one range for
the contiguous layout, two for zigzag). Each (query range, key range) pair is one block; blocks
that the causal or document mask hides completely are skipped, the others go to a kernel and
are merged per query with the LSE rule. ``docs`` is None (one document), one ``cu_seqlens``
tuple shared by the batch, or a tuple of them, one per sequence (packed batches: each sequence
has its own boundaries, so each one runs its own blocks). ``segment_attention`` wraps this in an autograd function
for the modes that see all their keys at once (Ulysses, all-gather, cp=1).
"""

from __future__ import annotations

from typing import Iterator

import torch

from .kernels import BlockMask, block_backward, block_forward, merge_partial_
from .sharding import Segments


def iter_blocks(q_segs: Segments, k_segs: Segments, causal: bool, docs) -> Iterator[tuple[slice, slice, BlockMask]]:
    """(local query slice, local key slice, mask) of every block that is not fully masked."""
    q_off = 0
    for qa, qb in q_segs:
        k_off = 0
        for ka, kb in k_segs:
            mask = BlockMask(qa, qb, ka, kb, causal, docs).clipped()
            if not mask.is_empty():
                k_lo = k_off + mask.k_start - ka
                yield slice(q_off, q_off + qb - qa), slice(k_lo, k_lo + mask.k_len), mask
            k_off += kb - ka
        q_off += qb - qa


def per_sequence(docs) -> list[tuple[slice, tuple[int, ...] | None]]:
    """(batch slice, its document boundaries): the whole batch when they are shared, else one per sequence."""
    if docs is None or isinstance(docs[0], int):
        return [(slice(None), docs)]
    return [(slice(b, b + 1), d) for b, d in enumerate(docs)]


def segments_forward(q, k, v, q_segs, k_segs, causal, docs, scale, backend, out=None, lse=None):
    """Merge the attention of q against this key shard into (out, lse) (fp32; new when None)."""
    fresh, reached = out is None, set()  # a new accumulator: each query slice's first block is a copy
    if fresh:
        sq, b, hq, d = q.shape
        out = torch.zeros(sq, b, hq, d, device=q.device)
        lse = torch.full((b, hq, sq), float("-inf"), device=q.device)
    for bs, seq_docs in per_sequence(docs):
        for qs, ks, mask in iter_blocks(q_segs, k_segs, causal, seq_docs):
            o, l = block_forward(q[qs, bs], k[ks, bs], v[ks, bs], mask, scale, backend)
            if fresh and (bs.start, qs.start) not in reached:
                reached.add((bs.start, qs.start))
                out[qs, bs], lse[bs, :, qs] = o, l
            else:
                merge_partial_(out[qs, bs], lse[bs, :, qs], o, l)  # views: the accumulators in place
    return out, lse


def segments_backward(dout, q, k, v, out, lse, q_segs, k_segs, causal, docs, scale, backend, dq=None):
    """Add this key shard's share to dq (fp32, new when None); return (dq, dk, dv) with fp32 dk, dv."""
    dq = torch.zeros(q.shape, device=q.device) if dq is None else dq
    dk = torch.zeros(k.shape, device=k.device)
    dv = torch.zeros(v.shape, device=v.device)
    for bs, seq_docs in per_sequence(docs):
        for qs, ks, mask in iter_blocks(q_segs, k_segs, causal, seq_docs):
            a, b, c = block_backward(dout[qs, bs], q[qs, bs], k[ks, bs], v[ks, bs], out[qs, bs], lse[bs, :, qs],
                                     mask, scale, backend)
            dq[qs, bs] += a
            dk[ks, bs] += b
            dv[ks, bs] += c
    return dq, dk, dv


class _SegmentAttention(torch.autograd.Function):
    """Forward: attention of local queries against keys held locally; backward: its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, q_segs, k_segs, causal, docs, scale, backend):
        out, lse = segments_forward(q, k, v, q_segs, k_segs, causal, docs, scale, backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (q_segs, k_segs, causal, docs, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = segments_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def segment_attention(q, k, v, q_segs: Segments, k_segs: Segments, causal: bool, docs, scale: float, backend: str = "auto"):
    return _SegmentAttention.apply(q, k, v, tuple(q_segs), tuple(k_segs), causal, docs, scale, backend)
