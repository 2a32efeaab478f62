"""Buddy shards (``buddy_shards=1``, ZeRO-1, 2 or 3): rank ``i`` of a sharding group of ``d`` also steps shard
``(i + 1) % d``, a live copy of its neighbour's optimizer range that the neighbour's loss leaves behind; where a
replica (the ranks lost together) is several consecutive ranks of the group, shard ``(i + buddy_stride) % d``, the
next replica's (bucket_groups.py; the experts' group holds one rank of each replica: stride 1).

The copy is bitwise without sending any state each step: the gradients are all-reduced in place (every rank
reads the same reduced values, the owner's range and its buddy's alike), the buddy's master starts from the
same values as the owner's, and the update is the same element-wise arithmetic over a range of the same
length. Under ZeRO-1/2 the params the all-gather brings after the step overwrite the buddy range with the
owner's update, which is the same bits. ZeRO-3 keeps no full params at rest: the buddy's master is a copy of
its own (the next rank's param shard itself in fp32; in bf16 the param shard is its master cast, as the
owner's is), stepped beside the owner's and never sent. What it costs: the buddy's optimizer state (and fp32
master where the params are not fp32, or under ZeRO-3 where they are), and an all-reduce of the gradients where
ZeRO-1/2/3 reduce-scatter them. Under ZeRO-2/3, which keep only a shard of the reduced gradients, the all-reduced
buffer leaves two shards behind, the rank's own and its buddy's (a second gradient shard), and goes.
"""

from __future__ import annotations

import torch


class BuddyRange:
    """Shard ``(i + 1) % d`` of a sharded bucket, stepped by its rank ``i`` too: what the optimizer loops read
    of a bucket (``master``, ``opt_grad``, ``opt_segments``)."""

    def __init__(self, bucket, shard: int, master: torch.Tensor) -> None:
        self.bucket, self.shard = bucket, shard
        self.params, self.offsets, self.device = bucket.params, bucket.offsets, bucket.device
        self.opt_lo, self.opt_hi = shard * bucket.S, (shard + 1) * bucket.S
        self.master = master
        self.grad: torch.Tensor | None = None  # ZeRO-2/3: the buddy's reduced gradient shard, kept from the full buffer
        self.ortho: torch.Tensor | None = None  # Muon: this range of the owners' orthogonalized update (muon_buddy.py)

    @property
    def opt_grad(self) -> torch.Tensor:
        """The reduced grads of the buddy's range: a view of the bucket's all-reduced full buffer (ZeRO-1), or the
        shard kept from it (ZeRO-2/3; zeros if no synced backward ran this step)."""
        if not self.bucket.cfg.shard_grads:
            return self.bucket.full_grad[self.opt_lo: self.opt_hi]
        if self.grad is None:
            self.grad = torch.zeros(self.opt_hi - self.opt_lo, dtype=self.bucket.cfg.grad_dtype, device=self.device)
        return self.grad

    def opt_segments(self):
        """As :meth:`Bucket.opt_segments`, over the buddy's range."""
        return type(self.bucket).opt_segments(self)
