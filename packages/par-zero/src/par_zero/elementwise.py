"""Any element-wise optimizer declaration (declaration.py) stepped over each rank's optimizer range.

An element-wise update of an element reads only that element's param, grad and state, so the update
of a rank's range (everything for 'no_shard', its shard under ZeRO-1/2/3) is the single-process update
of those elements: nothing is gathered. The state is the declaration's tensors over the range, saved
as pieces like the masters. Weight decay applies where ``decayed(param)`` holds, as the declaration
says: decoupled (the master scaled by ``1 - lr wd`` first, as torch's AdamW) or L2 (``wd`` times the
master added to the grad, as torch's SGD).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .bucket import Bucket
from .config import DataParallelConfig
from .optimizer import RangeStateOptimizer, contiguous_runs


class ElementwiseOptimizer(RangeStateOptimizer):
    """The declaration ``decl`` over the optimizer ranges of ``buckets``; ``lr`` may change every step."""

    def __init__(self, buckets: list[Bucket], cfg: DataParallelConfig, decayed: Callable[[nn.Parameter], bool],
                 decl):
        self.decl, self.KINDS, self.NAME = decl, decl.kinds(), decl.label
        self.buckets, self.cfg, self.lr, self.step_count = buckets, cfg, cfg.lr, 0
        self.state = {b: {s.name: torch.zeros_like(b.master, dtype=s.dtype) for s in decl.state()} for b in buckets}
        self.decay_ranges = {b: contiguous_runs([(lo, hi) for p, _, lo, hi, _ in b.opt_segments() if decayed(p)])
                             for b in buckets}

    @torch.no_grad()
    def _step_bucket(self, b: Bucket) -> None:
        wd, lr, runs = self.cfg.weight_decay, self.lr, self.decay_ranges[b]
        g = b.opt_grad
        l2 = wd and runs and self.decl.decay == "l2"
        if l2 or g.dtype != torch.float32:  # a copy: the reduced grads stay as they are
            g = g.float() if g.dtype != torch.float32 else g.clone()
        if l2:
            torch._foreach_add_([g[lo:hi] for lo, hi in runs], [b.master[lo:hi] for lo, hi in runs], alpha=wd)
        elif wd and runs:
            torch._foreach_mul_([b.master[lo:hi] for lo, hi in runs], 1 - lr * wd)
        self.decl.step_(b.master, g, self.state[b], step=self.step_count, lr=lr)
