"""ZeRO-1's param gathers after the step: several buckets per all-gather.

ZeRO-1 re-assembles each bucket's params from the shards the ranks stepped. One collective per
bucket costs a latency per bucket, which dominates on a latency-bound backend (gloo: 4 gathers of
a quarter of the bytes take ~3x one gather of them all), while DDP pays none of it. So consecutive
buckets of one gather group (up to ``GATHER_BUCKETS`` buckets' worth, ``bucket_mb`` each) are
gathered in one collective: their shards back to back in, then each bucket's rows copied out of
the rank-major output (``d`` rows of the buckets' shards side by side). The transient buffers are
that batch's params (and the input, 1/d of them); at most two batches are in flight.
"""

from __future__ import annotations

import torch

from par_groups import comm

from .bucket import Bucket

GATHER_BUCKETS = 4  # buckets' worth per gather: fewer latencies against a bounded transient buffer


class CoalescedGathers:
    """Feed stepped ZeRO-1 buckets with :meth:`add`; :meth:`finish` waits and writes the params."""

    def __init__(self, window: int):
        self.limit = GATHER_BUCKETS * window  # elements of gathered output per collective
        self.open: dict[int, list[Bucket]] = {}  # per gather group (by id): buckets not yet launched
        self.inflight: list[tuple[object, torch.Tensor, list[Bucket]]] = []

    def add(self, bucket: Bucket) -> None:
        bucket.write_master()
        batch = self.open.setdefault(id(bucket.groups.gather_group), [])
        batch.append(bucket)
        if sum(b.N for b in batch) >= self.limit:
            self._launch(self.open.pop(id(bucket.groups.gather_group)))

    def _launch(self, batch: list[Bucket]) -> None:
        while len(self.inflight) > 1:  # bound the transient buffers: at most two batches in flight
            self._complete(*self.inflight.pop(0))
        mine = torch.cat([b.own_params() for b in batch])
        out = mine.new_empty(batch[0].groups.d * mine.numel())
        work = comm.all_gather_into_tensor(out, mine, batch[0].groups.gather_group, async_op=True)
        self.inflight.append((work, out, batch))

    @staticmethod
    @torch.no_grad()
    def _complete(work, out: torch.Tensor, batch: list[Bucket]) -> None:
        work.wait()
        d = batch[0].groups.d
        for b, rows in zip(batch, out.view(d, -1).split([b.S for b in batch], dim=1)):
            b.full_param.view(d, b.S).copy_(rows)  # rank r's rows are the bucket's shard r

    def finish(self) -> None:
        for batch in list(self.open.values()):
            self._launch(batch)
        self.open.clear()
        while self.inflight:
            self._complete(*self.inflight.pop(0))
