"""The checkpoint that reruns a recomputed module's forward exactly (``[model].recompute``:
``recompute_policy``).

A recomputed forward is the original, bit for bit: :func:`checkpointed` replays, in the rerun,
what the first run drew or decided rather than drawing it again: torch's RNG state (torch's
checkpoint), the dropout masks' place in the batch (``dropout.position``) and every MoE layer's
routing (``par_moe.replay``: the experts the first run chose, whatever the rerun's router
scores say; its load counters are not counted twice).
"""

from __future__ import annotations

from par_moe import RoutingTape

from . import dropout
from .te import recompute as backend_checkpoint


def checkpointed(fn, *args, backend: str = "torch"):
    """``fn(*args)``, its activations recomputed in the backward (``te.recompute``: TE's checkpoint or
    torch's), the rerun replaying the first run's RNG, dropout place and MoE routing."""
    return backend_checkpoint(_Replayed(fn), *args, backend=backend)


class _Replayed:
    """``fn`` that records on its first call and replays on every later one (the checkpoint's reruns)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls, self.position, self.tape = fn, 0, None, RoutingTape()

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            self.position = dropout.position()
            with self.tape.recording():
                return self.fn(*args)
        outside = dropout.position()
        dropout.set_position(*self.position)
        try:
            with self.tape.replay():
                return self.fn(*args)
        finally:
            dropout.set_position(*outside)
