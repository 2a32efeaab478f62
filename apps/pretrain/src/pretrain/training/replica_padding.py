"""Under ZeRO-3 over the whole dp (``[train].buddy_shards = 1``), every replica runs as many micro-batches as the
busiest one.

A generation of ``D'`` replicas splits a step's ``M`` micro-batches ``floor`` or ``ceil(M / D')`` to a replica
(fault_replica.py's ``ReplicaShare``). ZeRO-3 gathers each unit's params over the whole dp in every micro-batch's
forward and backward, so ranks running fewer micro-batches would leave the others' gathers unanswered. A replica
short of ``ceil(M / D')`` runs the missing ones as copies of its first micro-batch whose loss weighs 0: their
gradients are zeros, their loss adds 0 to the step's mean, and each real micro-batch's weight is scaled to the
padded count (the accumulation divides by it). Under a pipeline every stage reads and pads the same share, and its
schedule is built for the padded count, so each stage's gathers over its dp group match; under eod_mask_loss the
global batch's kept predictions count the real micro-batches only (a copy's are not in the global batch).
"""

from __future__ import annotations

import torch

from ..data.sampler import Batch


def pads(cfg) -> bool:
    """Whether a replica's micro-batches are padded: ZeRO-3 sharded over the whole dp."""
    return bool(cfg.train.buddy_shards) and cfg.parallel.zero == "optim_grads_params"


def padding(share) -> int:
    """The micro-batches ``share`` (a ``ReplicaShare``) runs beyond its own: up to ``ceil(M / D')``."""
    return -(-share.microbatches // share.alive) - share.count


def padded(batch: Batch, extra: int) -> Batch:
    """``batch`` (micro-batches first) with ``extra`` copies of its first micro-batch after its own."""
    if not extra:
        return batch
    more = lambda t: torch.cat([t, t[:1].expand(extra, *t.shape[1:])])  # noqa: E731
    return Batch(more(batch.tokens), more(batch.segments))
