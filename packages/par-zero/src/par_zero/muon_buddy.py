"""Muon over the buddy ranges (``buddy_shards=1``, buddy.py): rank ``i`` steps shard ``(i + stride) % d``'s momentum,
AdamW moments and master beside its own, bitwise as that shard's owner does.

The element-wise part is the owner's arithmetic over a range of the same length, from the same all-reduced
gradients: the AdamW runs and the momentum (the update torch's Nesterov step derives from it). The matrix-wise part
is not recomputed: the owner's step (muon.py) all-gathers every rank's update, runs Newton-Schulz on its whole
matrices and sums the owners' results over the sharding group; with a buddy that sum is an all-reduce in place of the
reduce-scatter, so every rank holds the whole bucket's orthogonalized update, the owners' own values, and leaves its
buddy range of it on the buddy (``BuddyRange.ortho``). The buddy applies it after its own momentum step: no
collective of its own, so a step whose collectives a lost peer interrupts leaves the buddy as it was too.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import DataParallelConfig
from .muon import DistributedMuon


class BuddyMuon(DistributedMuon):
    """Muon's state and update over ``buddies`` (buddy.py's ranges), stepped after the owned ranges' step of the same
    buckets (DataParallel.step), from the result it left on each buddy range."""

    def __init__(self, buddies: list, cfg: DataParallelConfig, decayed: Callable[[nn.Parameter], bool],
                 is_matrix: Callable[[nn.Parameter], bool]):
        self._init_state(buddies, cfg, decayed, is_matrix)
        self.owners = []

    def step(self, each=None) -> None:
        super(DistributedMuon, self).step(each)  # no collectives: the owned step ran them

    @torch.no_grad()
    def _step_bucket(self, b) -> None:
        g = self._grad(b)
        self._adamw_runs(b, g)
        if not self.matrices[b]:
            return
        ortho = getattr(b, "ortho", None)
        if ortho is None:
            raise RuntimeError("a Muon buddy range steps after its bucket's owned step, which leaves it the "
                               "orthogonalized update: none was left this step")
        self._momentum_step(b, g, self.state[b]["momentum_buffer"])
        self._apply_muon(b, ortho)
        b.ortho = None  # each step's own: never applied twice
