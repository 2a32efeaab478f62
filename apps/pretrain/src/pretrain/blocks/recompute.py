"""The checkpoint that reruns a recomputed module's forward exactly (``[model].recompute``:
``recompute_policy``).

A recomputed forward is the original, bit for bit: :func:`checkpointed` replays, in the rerun,
what the first run drew or decided rather than drawing it again: torch's RNG state (torch's
checkpoint), the dropout masks' place in the batch (the model's ``dropout.DropoutPosition``) and every MoE layer's
routing (``par_moe.replay``: the experts the first run chose, whatever the rerun's router
scores say; its load counters are not counted twice).
"""

from __future__ import annotations

from par_moe import RoutingTape

from .te import recompute as backend_checkpoint


def checkpointed(fn, *args, backend: str = "torch", dropout=None, replay: bool = True):
    """``fn(*args)``, its activations recomputed in the backward (``te.recompute``: TE's checkpoint or
    torch's), the rerun replaying the first run's RNG, MoE routing and, given the model's
    ``dropout.DropoutPosition``, its place in the batch (a later micro-batch's forward may have moved it).
    ``replay=False`` (no routing and no dropout inside ``fn``): torch's checkpoint alone, which
    torch.compile traces into a compiled block's graph (the replaying wrapper's state would not be)."""
    return backend_checkpoint(_Replayed(fn, dropout) if replay else fn, *args, backend=backend)


class _Replayed:
    """``fn`` that records on its first call and replays on every later one (the checkpoint's reruns)."""

    def __init__(self, fn, dropout) -> None:
        self.fn, self.dropout, self.calls, self.at, self.tape = fn, dropout, 0, None, RoutingTape()

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            self.at = None if self.dropout is None else self.dropout.at
            with self.tape.recording():
                return self.fn(*args)
        outside = None if self.dropout is None else self.dropout.at
        if self.dropout is not None:
            self.dropout.at = self.at
        try:
            with self.tape.replay():
                return self.fn(*args)
        finally:
            if self.dropout is not None:
                self.dropout.at = outside
