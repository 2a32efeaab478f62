"""What one training step returns, kept on the device until someone reads it.

On a GPU every host read of a tensor value (``.item()``, ``float(t)``) stops the CPU from queueing
kernels until the stream drains. So a step's loss, grad norm and MoE statistics stay device tensors:
the run reads them at log steps only (``StepResult.loss`` and friends read when asked), and a
non-finite step is noted on the device (:class:`NonFinite`) and read at the next log or checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UsageError


@dataclass
class StepResult:
    step: int
    loss_t: torch.Tensor  # the global batch's mean loss (a device scalar)
    lr: float
    grad_norm_t: torch.Tensor  # the global pre-clip grad norm (a device scalar)
    tokens: int
    moe_t: dict = field(default_factory=dict)  # device scalars (MoE imbalance ...)
    skipped: bool = False  # non-finite loss under [train].nan_policy=skip: no update was applied
    placement: dict | None = None  # a re-placement step's change (step, experts moved, bytes moved): host values

    @property
    def loss(self) -> float:  # a host read
        return float(self.loss_t)

    @property
    def grad_norm(self) -> float:  # a host read
        return float(self.grad_norm_t)

    @property
    def moe(self) -> dict:  # one host read for all of them
        return dict(zip(self.moe_t, torch.stack(list(self.moe_t.values())).tolist())) if self.moe_t else {}


class NonFinite:
    """The first step whose loss or grad norm was not finite, tracked on the device (no host read per
    step); :meth:`check` reads it (one read) and raises the run's one-line stop."""

    def __init__(self, device: torch.device) -> None:
        self.first = torch.full((3,), -1.0, dtype=torch.float64, device=device)  # step, loss, grad norm

    def note(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Record step ``step`` (0-based) if it is the first non-finite one; returns its finite flag."""
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        here = torch.stack([torch.full_like(loss, step, dtype=torch.float64), loss.double(), norm.double()])
        self.first.copy_(torch.where((self.first[0] < 0) & ~finite, here, self.first))
        return finite

    def check(self) -> None:
        step, loss, norm = self.first.tolist()
        if step >= 0:
            raise UsageError(f"loss is {loss} (grad norm {norm}) at step {int(step) + 1}; stopping "
                             f"([train].nan_policy=stop; 'skip' drops such steps instead)")
