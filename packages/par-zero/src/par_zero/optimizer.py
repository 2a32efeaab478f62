"""The distributed optimizer: AdamW on each rank's optimizer range of every bucket.

Each bucket holds, for its optimizer range (everything for 'no_shard', the owned shard when
sharded), the reduced grads and the fp32 master; this optimizer keeps the AdamW moments of that
range and steps it, with torch.optim.AdamW's arithmetic. Weight decay applies to the params for
which ``decayed(param)`` holds, as ranges of the optimizer range. Re-assembling the params from
the masters afterwards is the buffer's job (:meth:`GradBuffer.sync_params`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .adamw import adamw_step_
from .bucket import Bucket
from .config import DataParallelConfig


MOMENTS = ("exp_avg", "exp_avg_sq")


class DistributedAdamW:
    """AdamW over the optimizer ranges of ``buckets``; ``lr`` may change every step (``set_lr``)."""

    def __init__(self, buckets: list[Bucket], cfg: DataParallelConfig, decayed: Callable[[nn.Parameter], bool]):
        self.buckets = buckets
        self.cfg = cfg
        self.lr = cfg.lr
        self.step_count = 0
        # {bucket: {moment: tensor over its optimizer range}}, as torch.optim's per-param ``state``
        self.state = {b: {k: torch.zeros_like(b.master, dtype=torch.float32) for k in MOMENTS}
                      for b in buckets}
        self.decay_ranges = {b: [(lo, hi) for p, _, lo, hi, _ in b.opt_segments() if decayed(p)] for b in buckets}

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def range_state(self, bucket: Bucket, kind: str) -> torch.Tensor:
        """``bucket``'s ``kind`` ('master', 'exp_avg' or 'exp_avg_sq') over its optimizer range."""
        if kind not in ("master",) + MOMENTS:
            raise ValueError(f"kind={kind!r} is not one of master, {', '.join(MOMENTS)}")
        return bucket.master if kind == "master" else self.state[bucket][kind]

    # the checkpoint interface shared with TorchOptimizer: the step count is the wrapper's
    def state_kinds(self) -> tuple[str, ...]:
        return MOMENTS

    def scalar_state(self) -> dict[str, float]:
        return {}

    def prepare_load(self, kinds) -> None:
        if tuple(kinds) != MOMENTS:
            raise ValueError(f"AdamW loads the state {', '.join(MOMENTS)}, not {', '.join(kinds) or 'none'}")

    def finish_load(self, scalars: dict[str, float]) -> None:
        pass

    def state_tensors(self) -> list[torch.Tensor]:
        """The moments (for measuring bytes; the masters are the buckets')."""
        return [t for moments in self.state.values() for t in moments.values()]

    def step(self, each: Callable[[Bucket], None] | None = None) -> None:
        """One AdamW update of every bucket's master (the params are not re-assembled here);
        ``each(bucket)`` runs after each bucket's update (the buffer launches its param gather
        there, so it runs while the next bucket steps)."""
        self.step_count += 1
        for b in self.buckets:
            self._step_bucket(b)
            if each is not None:
                each(b)

    @torch.no_grad()
    def _step_bucket(self, b: Bucket) -> None:
        c, lr = self.cfg, self.lr
        grad = b.opt_grad if b.opt_grad.dtype == torch.float32 else b.opt_grad.float()
        m, v = self.state[b]["exp_avg"], self.state[b]["exp_avg_sq"]
        for lo, hi in self.decay_ranges[b] if c.weight_decay else ():  # decoupled decay first, as torch's AdamW
            b.master[lo:hi].mul_(1 - lr * c.weight_decay)
        adamw_step_(b.master, grad, m, v, step=self.step_count, lr=lr, betas=c.betas, eps=c.eps, weight_decay=0.0)
