"""The process groups one family of buckets (dense or expert) communicates over: sharding, HSDP replicas, gathers."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class BucketGroups:
    """The groups one family of buckets (dense or expert) communicates over."""

    inner: ProcessGroup | None  # the sharding group (the whole DP group without HSDP)
    outer: ProcessGroup | None = None  # HSDP replicas
    all_gather: ProcessGroup | None = None  # same ranks as inner; separate so gathers overlap reductions
    # buddy_shards: rank i's buddy is shard (i + buddy_stride) % d, the first rank of the next replica where a
    # replica (the ranks lost together) is buddy_stride consecutive ranks of the sharding group; none in one replica
    buddy_stride: int = 1

    @property
    def d(self) -> int:
        return dist.get_world_size(self.inner)

    @property
    def r(self) -> int:
        return dist.get_world_size(self.outer) if self.outer is not None else 1

    @property
    def gather_group(self) -> ProcessGroup | None:
        return self.all_gather if self.all_gather is not None else self.inner
