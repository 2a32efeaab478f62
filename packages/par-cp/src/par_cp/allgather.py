"""All-gather (Megatron cp_comm_type='allgather'): every rank gathers the full K and V.

One all-gather of the packed K|V shards forward (a reduce-scatter of dK|dV backward); the local
queries then attend to the whole sequence. The gathered K/V stay in rank order, not sorted into
global order: each gathered shard keeps its global token ranges as key segments, so the causal
offset of every query is still its global position (zigzag shards included), without a copy of
the gathered tensor, and every block is either unmasked or a square diagonal one (the fused
kernel's shapes). Backward, dK|dV come out in the same rank order, which is what the
reduce-scatter sends home. Simple, memory-hungry, no overlap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from par_groups import all_gather_dim0, reduce_scatter_dim0

from .segments import segments_backward, segments_forward
from .sharding import Segments


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, q_segs, k_segs, causal, docs, scale, backend):
        kv = all_gather_dim0(torch.stack([k, v], dim=1), group)  # [P*S_local, 2, B, Hkv, D], rank order
        out, lse = segments_forward(q, kv[:, 0], kv[:, 1], q_segs, k_segs, causal, docs, scale, backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.group, ctx.args = group, (q_segs, k_segs, causal, docs, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq, dk, dv = segments_backward(dout, q, kv[:, 0], kv[:, 1], out, lse, *ctx.args)
        dkv = torch.empty_like(kv)  # dK|dV packed for one reduce-scatter (the cast to K's dtype rides the copy)
        dkv[:, 0], dkv[:, 1] = dk, dv
        local = reduce_scatter_dim0(dkv, ctx.group)
        return dq.to(q.dtype), local[:, 0], local[:, 1], None, None, None, None, None, None, None


def allgather_attention(q, k, v, group, segments: list[Segments], causal: bool, docs, scale: float, backend: str = "auto"):
    """All-gather CP over ``group``; ``segments[i]`` are the global token ranges of group rank i's shard."""
    k_segs = tuple(r for s in segments for r in s)  # the gathered shards, end to end in rank order
    q_segs = tuple(segments[dist.get_rank(group)])
    return _AllGatherAttention.apply(q, k, v, group, q_segs, k_segs, causal, docs, scale, backend)
