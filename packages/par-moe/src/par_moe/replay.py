"""Routing replay for recomputed forwards (activation checkpointing).

A checkpointed region that holds MoE layers runs their forward twice: once in the forward, once
again in the backward. The rerun must route every token to the experts the first run chose: a
router whose scores come out different in the last bits (another kernel, another reduction
order) would otherwise pick other experts, and the backward would not be the forward's. The
checkpoint records into a :class:`RoutingTape` on its first run and replays it on the reruns;
the MoE layers read and write the innermost active tape (:func:`active`). A replayed forward
adds nothing to the layer's load counters: its tokens were counted once.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_stack = threading.local()


class RoutingTape:
    """The chosen experts of each MoE forward of one checkpointed region, in call order."""

    def __init__(self) -> None:
        self.records: list[torch.Tensor] = []
        self.cursor = 0
        self.replaying = False

    def record(self, indices: torch.Tensor) -> None:
        self.records.append(indices.detach())

    def next(self) -> torch.Tensor:
        if self.cursor >= len(self.records):
            raise RuntimeError("routing replay: the rerun of a checkpointed region routes more MoE forwards "
                               f"than its first run ({len(self.records)})")
        self.cursor += 1
        return self.records[self.cursor - 1]

    @contextmanager
    def _active(self, replaying: bool):
        stack = _stack.__dict__.setdefault("tapes", [])
        self.replaying, self.cursor = replaying, 0
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    def recording(self):
        return self._active(False)

    def replay(self):
        return self._active(True)


def active() -> RoutingTape | None:
    """The innermost tape of this thread's running checkpointed regions, or None."""
    stack = getattr(_stack, "tapes", None)
    return stack[-1] if stack else None
