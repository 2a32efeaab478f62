"""Learning rate: linear warmup, then a decay to ``min_lr`` (Megatron's styles and arithmetic).

After the warm-up, step ``s`` (0-based) gets Megatron's ``OptimizerParamScheduler`` LR at
``num_steps = s``; during it, at ``num_steps = s + 1`` (Megatron's first step runs at LR 0, par's at
lr / warmup_steps). With sample-based keys (``[train].train_samples``, ``lr_*_samples``) the
position is ``s x global_batch`` samples and every bound is in samples, as Megatron's.
"""

from __future__ import annotations

import math

from ..config.train_section import schedule_bounds  # noqa: F401 - the bounds, importable from here


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, steps: int) -> float:
    """LR for optimizer step ``step`` (0-based) of the cosine schedule. Depends only on the schedule, not on stop_at."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def lr_for(step: int, t) -> float:
    """LR for optimizer step ``step`` (0-based) under the ``[train]`` section ``t``'s schedule."""
    unit, warmup, decay, wsd = schedule_bounds(t)
    if t.lr_decay_style == "cosine" and unit == 1:  # the arithmetic par always had (bitwise the same runs)
        return lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=warmup, steps=decay)
    pos = step * unit
    if warmup > 0 and pos + unit <= warmup:
        return t.lr * (pos + unit) / warmup
    return megatron_lr(pos, lr=t.lr, min_lr=t.min_lr, warmup=warmup, decay=decay, style=t.lr_decay_style,
                       wsd_decay=wsd, wsd_style=t.lr_wsd_decay_style)


def megatron_lr(num: int, *, lr: float, min_lr: float, warmup: int, decay: int, style: str, wsd_decay: int,
                wsd_style: str) -> float:
    """Megatron-LM's ``OptimizerParamScheduler.get_lr`` at ``num_steps = num`` (its init_lr: 0)."""
    if warmup > 0 and num <= warmup:
        return lr * num / warmup
    if style == "constant":
        return lr
    if num > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * max(warmup, 1) ** 0.5 / max(num, 1) ** 0.5)
    ratio = (num - warmup) / max(decay - warmup, 1)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # wsd: stable at lr, then the last wsd_decay steps down to min_lr
        start = decay - wsd_decay
        if num <= start:
            coeff = 1.0
        else:
            r = (num - start) / wsd_decay
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": 2.0 * 0.5 ** r - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[wsd_style]
    return min_lr + coeff * (lr - min_lr)
