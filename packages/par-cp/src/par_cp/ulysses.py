"""Ulysses (Megatron cp_comm_type='a2a'): trade the sequence split for a head split.

All-to-all #1 turns each rank's ``[S/P, B, H, D]`` into ``[S, B, H/P, D]`` (q, k and v packed in
one call), plain attention runs on the full sequence for H/P heads, all-to-all #2 turns the
output back to ``[S/P, B, H, D]``. Two all-to-all phases forward (and two backward, reversed).
GQA: query heads and key/value heads are split into P contiguous groups, which keeps every
query head with its key/value head; both counts must be divisible by P.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from par_groups import comm
from par_groups.autograd import conjugate_pair

from .segments import segment_attention
from .sharding import Segments, merge_segments, segment_indices


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like would copy a permuted layout
    comm.all_to_all_single(out, x, group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[S/P, B, H, D] -> [S, B, H/P, D]: send head group j to rank j, stack received shards in rank order."""
    p = dist.get_world_size(group)
    s, b, h, d = x.shape
    x = x.reshape(s, b, p, h // p, d).permute(2, 0, 1, 3, 4)
    return _all_to_all(x, group).reshape(p * s, b, h // p, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[S, B, H/P, D] -> [S/P, B, H, D]: the inverse of :func:`_seq_to_heads`."""
    p = dist.get_world_size(group)
    s, b, h, d = x.shape
    y = _all_to_all(x.reshape(p, s // p, b, h, d), group)
    return y.permute(1, 2, 0, 3, 4).reshape(s // p, b, p * h, d)


# SeqToHeads: forward all-to-all sequence shards -> head shards, backward the reverse all-to-all;
# HeadsToSeq the other way round.
SeqToHeads, HeadsToSeq = conjugate_pair(_seq_to_heads, _heads_to_seq, ("SeqToHeads", "HeadsToSeq"))


def check_heads(num_q_heads: int, num_kv_heads: int, a2a_size: int) -> None:
    bad = [f"{name}={n}" for name, n in (("local query heads", num_q_heads), ("local key/value heads", num_kv_heads)) if n % a2a_size]
    if bad:
        raise ValueError(
            f"Ulysses (a2a) splits heads over {a2a_size} ranks, but {' and '.join(bad)} (after TP) "
            f"{'is' if len(bad) == 1 else 'are'} not divisible by {a2a_size}; use an a2a size dividing "
            f"both head counts, or the p2p/allgather mode"
        )


def heads_scatter(q, k, v, group):
    """a2a #1 on q, k, v packed in one call: returns full-sequence q, k, v with 1/P of the heads."""
    p = dist.get_world_size(group)
    s, b, hq, d = q.shape
    hkv = k.shape[2]
    check_heads(hq, hkv, p)
    packed = torch.cat([t.reshape(s, b, p, -1, d) for t in (q, k, v)], dim=3).reshape(s, b, -1, d)
    full = SeqToHeads.apply(packed, group)
    return full.split([hq // p, hkv // p, hkv // p], dim=2)


def gathered_order(segments: list[Segments], device=None) -> tuple[torch.Tensor, torch.Tensor, Segments]:
    """After an a2a the shards of all group ranks lie end to end; return the permutation that
    sorts them by global position (on ``device``), its inverse, and the sorted (merged) segments."""
    index = torch.cat([segment_indices(s, device) for s in segments])
    order = torch.argsort(index)
    return order, torch.argsort(order), merge_segments([r for s in segments for r in s])


def ulysses_attention(q, k, v, group, segments: list[Segments], causal: bool, docs, scale: float, backend: str = "auto"):
    """Ulysses over ``group``; ``segments[i]`` are the global token ranges of group rank i's shard."""
    qh, kh, vh = heads_scatter(q, k, v, group)
    order, inverse, merged = gathered_order(segments, q.device)
    qh, kh, vh = (t.index_select(0, order) for t in (qh, kh, vh))
    out = segment_attention(qh, kh, vh, merged, merged, causal, docs, scale, backend)
    return HeadsToSeq.apply(out.index_select(0, inverse), group)
