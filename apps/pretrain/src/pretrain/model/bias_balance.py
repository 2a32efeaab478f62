"""Aux-loss-free balancing (``[model].bias_update_rate > 0``) of a rank's MoE layers: after each optimizer
step every layer's expert bias moves by its routed pairs per expert, summed over the ranks that saw other
tokens (the stage's tp-dp-cp group), so every rank applies the same update. A skipped update's counts go
into the next one.

Under ``[train].fault_tolerance = "replica"`` (:meth:`BiasBalance.fold_each_step`, as the expert replacer's
``fold_each_step``) the counts are summed every step before the optimizer step (:meth:`~BiasBalance.count_step`)
and the bias moves after it with no collective: a replica lost after the update cannot leave the weights
updated and the bias not. A step that completes without its update (a skipped one) keeps its summed counts
for the next update (:meth:`~BiasBalance.commit`); a step a lost replica interrupted keeps nothing, so its
redo (the lost replica's micro-batches trained by the survivors) is counted once. What a step boundary holds
beyond the bias itself (a parameter-free buffer, in every rank's owned state) is those kept counts, alike on
every replica (:meth:`~BiasBalance.state`, :meth:`~BiasBalance.adopt`).
"""

from __future__ import annotations

import torch

from .moe import moe_layers


class BiasBalance:
    """The bias updates of a rank's MoE layers with a bias update rate, their counts summed over ``group``."""

    def __init__(self, layers: list, group) -> None:
        self.layers, self.group = layers, group
        self.each_step = False  # fold_each_step: the counts summed before the update
        self.pending: list[torch.Tensor] | None = None  # each_step: this step's summed counts (device)
        self.kept: list[torch.Tensor] | None = None  # each_step: completed steps' summed counts not yet applied

    @classmethod
    def of(cls, chunks, group) -> "BiasBalance | None":
        """The balancing of ``chunks``' MoE layers with a bias update rate (None: none has one), summed over ``group``."""
        layers = [moe for moe in moe_layers(chunks) if moe.config.bias_update_rate > 0]
        return cls(layers, group) if layers else None

    def fold_each_step(self) -> None:
        """Sum the counts before the update (:meth:`count_step`), none after it."""
        self.each_step = True

    def count_step(self) -> None:
        """each_step, before the step's update: its counts summed over the group (one all-reduce per layer)."""
        if self.each_step:
            self.pending = [moe.routed_load(self.group) for moe in self.layers]

    def update(self) -> None:
        """After the optimizer step: every layer's bias moved by its summed counts (without each_step: summed now)."""
        loads = self.pending if self.each_step else [moe.routed_load(self.group) for moe in self.layers]
        if self.kept is not None:
            loads = [a + b for a, b in zip(self.kept, loads)]
        for moe, load in zip(self.layers, loads):
            moe.apply_bias(load)
        self.pending = self.kept = None

    def commit(self) -> None:
        """The step completed: counts summed but not applied (its update skipped) go into the next update."""
        if self.pending is not None:
            self.kept = self.pending if self.kept is None else [a + b for a, b in zip(self.kept, self.pending)]
            self.pending = None

    def state(self) -> list[list[float]] | None:
        """At a step boundary (each_step): the kept counts per layer (None: none), alike on every replica; a step
        interrupted before its commit is not in them."""
        return None if self.kept is None else [load.tolist() for load in self.kept]

    def adopt(self, kept: list[list[float]] | None) -> None:
        """Go on from ``kept`` (:meth:`state`'s), nothing of this step counted."""
        if kept is not None and len(kept) != len(self.layers):
            raise RuntimeError(f"kept bias counts of {len(kept)} layers for {len(self.layers)}")
        self.pending = None
        self.kept = None if kept is None else [
            torch.tensor(row, dtype=moe.routed_since_update.dtype, device=moe.routed_since_update.device)
            for moe, row in zip(self.layers, kept)]
