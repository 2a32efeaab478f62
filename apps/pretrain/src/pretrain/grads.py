"""Finishing a step's gradients across dimensions, after DP has reduced them (Megatron's finalize).

par-zero holds gradients in flat buckets (``opt_grad``, this rank's reduced shard). Two kinds of
TP-partial gradients still need a sum over the TP group there: params replicated over TP but fed
a sequence shard (``sequence_parallel``), and KV-head weights replicated on ``tp_replicas`` ranks.
Sums are linear, so doing them after the DP mean gives the same result as before it; every TP
rank has identical buckets (same shapes), so the shards line up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from par_groups import comm


def sync_tp_partial_grads(dp, tp_group) -> int:
    """All-reduce (one call) the TP-partial grads held in ``dp``'s buckets; returns how many."""
    tp = dist.get_world_size(tp_group)
    if tp == 1:
        return 0
    rank = dist.get_rank(tp_group)
    views: list[tuple[torch.Tensor, int]] = []  # (view into opt_grad, replicas)
    for bucket in dp.buckets:
        for p, _, lo, hi, _ in bucket.opt_segments():
            if hi <= lo:
                continue
            if getattr(p, "sequence_parallel", False):
                views.append((bucket.opt_grad[lo:hi], tp))
            elif getattr(p, "tp_replicas", 1) > 1:
                views.append((bucket.opt_grad[lo:hi], p.tp_replicas))
    if not views:
        return 0
    chunks = []
    for v, replicas in views:
        if replicas == tp:
            chunks.append(v.reshape(-1))
        else:  # each replica writes into its head's slot, so only ranks sharing a head are summed
            slots = torch.zeros(tp // replicas, v.numel(), dtype=v.dtype)
            slots[rank // replicas] = v
            chunks.append(slots.reshape(-1))
    flat = torch.cat(chunks)
    comm.all_reduce(flat, tp_group)
    offset = 0
    for v, replicas in views:
        if replicas == tp:
            v.copy_(flat[offset:offset + v.numel()])
            offset += v.numel()
        else:
            n = (tp // replicas) * v.numel()
            v.copy_(flat[offset:offset + n].view(-1, v.numel())[rank // replicas])
            offset += n
    return len(views)


def counted_once(tp_rank: int):
    """For grad-norm: count each distinct parameter once over the TP group.

    TP-sharded params count on every rank (KV replicas on the first of their replicas); params
    replicated over TP count on TP rank 0 only; expert params (sharded over ep x etp) always.
    """

    def include(p) -> bool:
        if getattr(p, "is_expert", False):
            return True
        if getattr(p, "tensor_parallel", False):
            return tp_rank % getattr(p, "tp_replicas", 1) == 0
        return tp_rank == 0

    return include
