"""Hierarchical CP (Megatron cp_comm_type='a2a+p2p', sizes [inner, outer]).

Ulysses inside each inner group (bandwidth-hungry all-to-all on the fast links), ring across the
outer groups (latency-tolerant, overlapped). CP rank c = outer_rank * inner + inner_rank, which
matches par_groups' hcp levels (level 0 = consecutive CP members, level 1 = strided). With the
zigzag layout over all cp ranks, an inner group's shards, sorted, are exactly the zigzag shard
of the outer ring with 2*outer chunks, so the ring keeps its causal load balance.
"""

from __future__ import annotations

import torch.distributed as dist

from .ring import ring_attention
from .sharding import merge_segments, shard_segments
from .ulysses import HeadsToSeq, gathered_order, heads_scatter


def hierarchical_cp_rank(inner_group, outer_group) -> tuple[int, int]:
    """(cp_rank, cp_size) of this rank in the combined CP group."""
    inner, outer = dist.get_world_size(inner_group), dist.get_world_size(outer_group)
    return dist.get_rank(outer_group) * inner + dist.get_rank(inner_group), inner * outer


def hierarchical_attention(q, k, v, inner_group, outer_group, seq_len: int, layout: str, causal: bool, docs, scale: float, backend: str = "auto"):
    inner, outer = dist.get_world_size(inner_group), dist.get_world_size(outer_group)
    cp = inner * outer
    me = dist.get_rank(outer_group)
    segs = [shard_segments(seq_len, c, cp, layout) for c in range(cp)]
    qh, kh, vh = heads_scatter(q, k, v, inner_group)
    order, inverse, _ = gathered_order(segs[me * inner:(me + 1) * inner], q.device)
    qh, kh, vh = (t.index_select(0, order) for t in (qh, kh, vh))
    outer_segs = [merge_segments([r for s in segs[o * inner:(o + 1) * inner] for r in s]) for o in range(outer)]
    out = ring_attention(qh, kh, vh, outer_group, outer_segs, causal, docs, scale, backend)
    return HeadsToSeq.apply(out.index_select(0, inverse), inner_group)
