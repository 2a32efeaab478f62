"""Learning rate: linear warmup, then cosine decay to ``min_lr`` at ``steps``."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, steps: int) -> float:
    """LR for optimizer step ``step`` (0-based). Depends only on the schedule, not on stop_at."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
