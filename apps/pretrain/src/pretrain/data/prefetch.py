"""The next step's batch, read while this step computes.

A :class:`Prefetcher` runs ``read(step)`` (this dp rank's share of a step, from the memory map) on one
background thread, one step ahead: ``get(step)`` waits for the batch read during the previous step (or
reads it now after a jump: the first step, a resume) and starts reading ``step + 1``. When the batches
go to a CUDA device their tensors are pinned on that thread, so the host-to-device copy that follows
(``.to(device, non_blocking=True)``) is a real asynchronous DMA; anywhere else they stay as read
(pinning pageable memory only pays for a CUDA copy), so a CPU run sees the very tensors it read before.

``read`` must not share mutable state with the caller's thread: give it its own sampler.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields, replace
from typing import Callable

import torch


def pin(batch, device: torch.device):
    """``batch`` (a dataclass of tensors) with its tensors in pinned memory when ``device`` is CUDA."""
    if device.type != "cuda":
        return batch
    return replace(batch, **{f.name: getattr(batch, f.name).pin_memory() for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


class Prefetcher:
    def __init__(self, read: Callable[[int], object], device: torch.device):
        self.read, self.device = read, torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._pending: tuple[int, Future] | None = None

    def _load(self, step: int):
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # the current device is per thread: pin for this rank's GPU, not GPU 0
        return pin(self.read(step), self.device)

    def get(self, step: int):
        """Step ``step``'s batch; starts reading ``step + 1`` in the background."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            batch = pending[1].result()
        else:
            if pending is not None and not pending[1].cancel():
                pending[1].exception()  # already reading: wait, so only one thread reads at a time
            batch = self._load(step)
        self._pending = (step + 1, self._pool.submit(self._load, step + 1))
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending = None
