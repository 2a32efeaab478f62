"""All-gather (Megatron cp_comm_type='allgather'): every rank gathers the full K and V.

One all-gather of the packed K|V shards forward (a reduce-scatter of dK|dV backward); the local
queries then attend to the whole sequence, put back in global order so the causal offset of
each query is its global position (zigzag shards included). Simple, memory-hungry, no overlap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from par_groups import all_gather_along_dim0

from .segments import segment_attention
from .sharding import Segments
from .ulysses import gathered_order


def allgather_attention(q, k, v, group, segments: list[Segments], causal: bool, docs, scale: float, backend: str = "auto"):
    """All-gather CP over ``group``; ``segments[i]`` are the global token ranges of group rank i's shard."""
    p = dist.get_world_size(group)
    s = k.shape[0]
    kv = all_gather_along_dim0(torch.stack([k, v], dim=1), group)  # [P*S_local, 2, B, H, D]
    order, _, merged = gathered_order(segments, k.device)
    kv = kv.index_select(0, order)
    k_full, v_full = kv[:, 0], kv[:, 1]
    assert k_full.shape[0] == p * s
    return segment_attention(q, k_full, v_full, segments[dist.get_rank(group)], merged, causal, docs, scale, backend)
