"""Finishing a step's gradients across dimensions, after DP has reduced them (Megatron's finalize).

par-zero holds gradients in flat buckets (``opt_grad``, this rank's reduced shard). Two kinds of
TP-partial gradients still need a sum over the TP group there: params replicated over TP but fed
a sequence shard (``sequence_parallel``), and KV-head weights replicated on ``tp_replicas`` ranks.
Sums are linear, so doing them after the DP mean gives the same result as before it; every TP
rank has identical buckets (same shapes), so the shards line up.
"""

from __future__ import annotations

from par_tp import is_tp_partial, sum_partial_grads_


def sync_tp_partial_grads(dp, tp_group) -> int:
    """All-reduce (one call) the TP-partial grads held in ``dp``'s buckets; returns how many."""
    if tp_group.size() == 1:  # nothing is partial (and torch_fsdp2, which runs tp=1 only, has no buckets)
        return 0
    items = [(bucket.opt_grad[lo:hi], p) for bucket in dp.buckets
             for p, _, lo, hi, _ in bucket.opt_segments() if hi > lo and is_tp_partial(p)]
    return sum_partial_grads_(items, tp_group)


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
