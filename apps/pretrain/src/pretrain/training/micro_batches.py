"""What a training step takes in: this rank's micro-batches (a :class:`.step_result.StepResult` is what it gives out)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MicroBatches:
    """One step's micro-batches on this rank, as the forward and the loss take them."""

    inputs: list[torch.Tensor]  # token shards [S/cp, micro_batch] (dynamic CP: [T, 1])
    labels: list[torch.Tensor]  # alike; with MTP [..., 1 + depth] token streams
    docs: list = field(default_factory=list)  # packed data: each micro-batch's Documents; else empty
    loss_tokens: torch.Tensor | float | None = None  # eod_mask_loss / dynamic CP: kept predictions per (rank, micro-batch)
    cp_imbalance: float | None = None  # dynamic CP: this batch's attention-work imbalance


NO_DOCUMENTS = MicroBatches([], [])  # whole sequences (logits, a pipeline's default callbacks)
