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

from .adamw import adamw_step_, fused_adamw_available
from .bucket import Bucket
from .config import DataParallelConfig


MOMENTS = ("exp_avg", "exp_avg_sq")
GRAD_CHUNK = 1 << 22  # bf16 grads are stepped this many elements at a time through one fp32 scratch (16 MiB)


class RangeStateOptimizer:
    """The checkpoint interface of an optimizer whose state is a fixed set of tensors per bucket over its
    optimizer range (``KINDS``, in ``self.state[bucket]``); its step count is the wrapper's."""

    KINDS: tuple[str, ...] = ()
    NAME = ""

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def step(self, each: Callable[[Bucket], None] | None = None) -> None:
        """One update of every bucket's master (the params are not re-assembled here); ``each(bucket)`` runs
        after each bucket's update (the buffer launches that bucket's param gather there, so it runs while
        the next bucket steps)."""
        self.step_count += 1
        self._begin_step()
        for b in self.buckets:
            self._step_bucket(b)
            if each is not None:
                each(b)

    def _begin_step(self) -> None:
        """What a step does once before its buckets' updates (``step_count`` is the new step's)."""

    def _step_bucket(self, b: Bucket) -> None:
        raise NotImplementedError

    def range_state(self, bucket: Bucket, kind: str) -> torch.Tensor:
        """``bucket``'s ``kind`` ('master' or one of ``KINDS``) over its optimizer range."""
        if kind not in ("master",) + self.KINDS:
            raise ValueError(f"kind={kind!r} is not one of master, {', '.join(self.KINDS)}")
        return bucket.master if kind == "master" else self.state[bucket][kind]

    def state_kinds(self) -> tuple[str, ...]:
        return self.KINDS

    def scalar_state(self) -> dict[str, float]:
        return {}

    def prepare_load(self, kinds) -> None:
        if tuple(kinds) != self.KINDS:
            raise ValueError(f"{self.NAME} loads the state {', '.join(self.KINDS)}, not {', '.join(kinds) or 'none'}")

    def finish_load(self, scalars: dict[str, float]) -> None:
        pass

    def state_tensors(self) -> list[torch.Tensor]:
        """The state tensors (for measuring bytes; the masters are the buckets')."""
        return [t for kinds in self.state.values() for t in kinds.values()]


class DistributedAdamW(RangeStateOptimizer):
    """AdamW over the optimizer ranges of ``buckets``; ``lr`` may change every step (``set_lr``)."""

    KINDS, NAME = MOMENTS, "AdamW"

    def __init__(self, buckets: list[Bucket], cfg: DataParallelConfig, decayed: Callable[[nn.Parameter], bool]):
        self.buckets = buckets
        self.cfg = cfg
        self.lr = cfg.lr
        self.step_count = 0
        # {bucket: {moment: tensor over its optimizer range}}, as torch.optim's per-param ``state``
        self.state = {b: {k: torch.zeros_like(b.master, dtype=torch.float32) for k in MOMENTS}
                      for b in buckets}
        self.decay_ranges = {b: contiguous_runs([(lo, hi) for p, _, lo, hi, _ in b.opt_segments() if decayed(p)])
                             for b in buckets}
        # made once on the device of the tensors they serve, refilled in place every step:
        self._steps: dict[torch.device, torch.Tensor] = {}  # the fused kernel's step count
        self._scratch: dict[torch.device, torch.Tensor] = {}  # fp32 copy of a chunk of bf16 grads

    def _begin_step(self) -> None:
        for t in self._steps.values():  # the fused kernel's step count, refilled in place
            t.fill_(float(self.step_count))

    @torch.no_grad()
    def _step_bucket(self, b: Bucket) -> None:
        """Decoupled decay first (as torch's AdamW), one foreach call over the decayed runs; then Adam on
        the whole range, or chunk by chunk through an fp32 scratch when the grads are bf16."""
        c, lr, g = self.cfg, self.lr, b.opt_grad
        m, v = self.state[b]["exp_avg"], self.state[b]["exp_avg_sq"]
        if c.weight_decay and self.decay_ranges[b]:
            torch._foreach_mul_([b.master[lo:hi] for lo, hi in self.decay_ranges[b]], 1 - lr * c.weight_decay)
        fused = fused_adamw_available(b.master) if c.fused_adamw is None else c.fused_adamw
        kw = dict(step=self.step_count, lr=lr, betas=c.betas, eps=c.eps, weight_decay=0.0, fused=fused,
                  step_tensor=self._step_tensor(g.device) if fused else None)
        if g.dtype == torch.float32:
            adamw_step_(b.master, g, m, v, **kw)
            return
        scratch = self._scratch_for(g)
        for lo in range(0, g.numel(), scratch.numel()):
            hi = min(lo + scratch.numel(), g.numel())
            adamw_step_(b.master[lo:hi], scratch[: hi - lo].copy_(g[lo:hi]), m[lo:hi], v[lo:hi], **kw)

    def _step_tensor(self, device: torch.device) -> torch.Tensor:
        t = self._steps.get(device)
        if t is None:
            t = self._steps[device] = torch.full((), float(self.step_count), dtype=torch.float32, device=device)
        return t

    def _scratch_for(self, grad: torch.Tensor) -> torch.Tensor:
        size = min(GRAD_CHUNK, grad.numel())
        s = self._scratch.get(grad.device)
        if s is None or s.numel() < size:
            s = self._scratch[grad.device] = torch.empty(size, dtype=torch.float32, device=grad.device)
        return s


def contiguous_runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (sorted, disjoint) with the touching ones merged: ``[(0, 4), (4, 6), (8, 9)] -> [(0, 6), (8, 9)]``."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out
