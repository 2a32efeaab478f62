"""Ring attention (Megatron cp_comm_type='p2p'): key/value shards travel around the CP group.

Forward, step s on rank r: attend to the shard of rank r-s that is in hand while that shard is
sent to r+1 and the next one is received from r-1 (double buffer: the receive buffer of this
step is the send buffer of the next); partial results are merged in fp32 with the LSE rule.
Blocks the causal mask hides are skipped (with zigzag each step after the first does half a
block), diagonal blocks run causal. cp-1 transfers of one packed K|V shard per rank.

Backward rings too: the K|V shards go round again, and the gradient of a shard travels with it,
starting at the rank after its owner and ending at the owner, which adds its own share.
So per rank cp-1 K|V transfers and cp-1 dK|dV transfers; nothing is recomputed on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from par_groups import comm

from .segments import segments_backward, segments_forward
from .sharding import Segments

KV_TAG, DKV_TAG = 0, 1


class _Neighbours:
    """Global ranks of the next and previous member of ``group``, and the exchange helper."""

    def __init__(self, group):
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def start(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]):
        """Post sends to the next rank and receives from the previous one; return the work handles."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t, tag in recvs]
        return comm.batch_isend_irecv(ops) if ops else []


def _wait(works) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, segments, causal, docs, scale, backend):
        ring = _Neighbours(group)
        kv = torch.stack([k, v]).contiguous()  # one message per step
        spare = torch.empty_like(kv)
        out = lse = None
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            works = ring.start([(kv, KV_TAG)], [(spare, KV_TAG)]) if step < ring.size - 1 else []
            out, lse = segments_forward(q, kv[0], kv[1], segments[ring.rank], segments[src], causal, docs, scale, backend, out, lse)
            _wait(works)
            kv, spare = spare, kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.args = ring, (segments, causal, docs, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, (segments, causal, docs, scale, backend) = ctx.ring, ctx.args
        n, r = ring.size, ring.rank
        dout = dout.contiguous()
        kv = torch.stack([k, v]).contiguous()
        spare = torch.empty_like(kv)
        dq = None
        own_dkv = travelling = None  # travelling: accumulated dK|dV of the shard held last step
        for step in range(n):
            src = (r - step) % n
            sends, recvs = [], []
            if step < n - 1:
                sends.append((kv, KV_TAG))
                recvs.append((spare, KV_TAG))
            incoming = None
            if step >= 2:  # the previous rank finished its share of shard src one step ago
                sends.append((travelling, DKV_TAG))
                incoming = torch.empty_like(travelling)
                recvs.append((incoming, DKV_TAG))
            works = ring.start(sends, recvs)
            dq, dk, dv = segments_backward(dout, q, kv[0], kv[1], out, lse, segments[r], segments[src], causal, docs, scale, backend, dq)
            _wait(works)
            share = torch.stack([dk, dv])
            if step == 0:
                own_dkv = share
            else:
                travelling = share if incoming is None else incoming + share
            kv, spare = spare, kv
        if n > 1:  # the last accumulation goes home to its owner, the next rank
            incoming = torch.empty_like(travelling)
            _wait(ring.start([(travelling, DKV_TAG)], [(incoming, DKV_TAG)]))
            own_dkv = own_dkv + incoming
        return dq.to(q.dtype), own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, group, segments: list[Segments], causal: bool, docs, scale: float, backend: str = "auto"):
    """Ring attention over ``group``; ``segments[i]`` are the global token ranges of group rank i's
    shard (q, k, v of this rank hold ``segments[rank]``)."""
    return _RingAttention.apply(q, k, v, group, tuple(tuple(s) for s in segments), causal, docs, scale, backend)
