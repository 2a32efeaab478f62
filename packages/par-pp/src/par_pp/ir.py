"""The schedule IR: per rank, the ordered compute actions; messages are derived, never written.

Chunks are the model's pieces in forward order, ``0 .. num_chunks - 1``; ``chunk_ranks[c]`` is the
rank holding chunk ``c``. An action is ``F`` (forward), ``B`` (backward; ``split=True`` means
input-grad only, its weight grad comes later in a ``W``) or ``W`` (weight grad), each for one
(microbatch, chunk). A message exists wherever a dependency crosses ranks: the forward of chunk
``c`` sends its output to chunk ``c + 1``'s rank, the backward of chunk ``c`` sends its input grad
to chunk ``c - 1``'s rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int
    split: bool = False  # B only: input grad now, weight grad in a later W

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind {self.kind!r} is not one of {KINDS}")
        if self.split and self.kind != "B":
            raise ValueError(f"only B actions can be split, got {self}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}c{self.chunk}{'*' if self.split else ''}"


@dataclass(frozen=True)
class Message:
    """One point-to-point transfer: ``kind`` is "act" (forward output) or "grad" (input grad)."""

    kind: str
    microbatch: int
    chunk: int  # the consuming chunk
    src: int
    dst: int


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    chunk_ranks: tuple[int, ...]  # chunk id -> rank
    ranks: tuple[tuple[Action, ...], ...]  # per rank, in execution order
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_ranks)

    @property
    def vpp(self) -> int:
        return self.num_chunks // self.pp

    @property
    def last_chunk(self) -> int:
        return self.num_chunks - 1

    def chunks_on(self, rank: int) -> list[int]:
        return [c for c, r in enumerate(self.chunk_ranks) if r == rank]

    @property
    def has_split_backward(self) -> bool:
        return any(a.split for row in self.ranks for a in row)

    def input_message(self, action: Action) -> Message | None:
        """The message ``action`` must receive before it runs, if its producer is on another rank."""
        if action.kind == "F" and action.chunk > 0:
            src, dst = self.chunk_ranks[action.chunk - 1], self.chunk_ranks[action.chunk]
            return Message("act", action.microbatch, action.chunk, src, dst) if src != dst else None
        if action.kind == "B" and action.chunk < self.last_chunk:
            src, dst = self.chunk_ranks[action.chunk + 1], self.chunk_ranks[action.chunk]
            return Message("grad", action.microbatch, action.chunk, src, dst) if src != dst else None
        return None

    def output_message(self, action: Action) -> Message | None:
        """The message ``action`` sends when it finishes, if its consumer is on another rank."""
        if action.kind == "F" and action.chunk < self.last_chunk:
            src, dst = self.chunk_ranks[action.chunk], self.chunk_ranks[action.chunk + 1]
            return Message("act", action.microbatch, action.chunk + 1, src, dst) if src != dst else None
        if action.kind == "B" and action.chunk > 0:
            src, dst = self.chunk_ranks[action.chunk], self.chunk_ranks[action.chunk - 1]
            return Message("grad", action.microbatch, action.chunk - 1, src, dst) if src != dst else None
        return None

    def sends(self, rank: int) -> list[Message]:
        """This rank's sends, in the order it issues them."""
        out = (self.output_message(a) for a in self.ranks[rank])
        return [m for m in out if m is not None]

    def recvs(self, rank: int) -> list[Message]:
        """This rank's receives, in the order its actions consume them."""
        inp = (self.input_message(a) for a in self.ranks[rank])
        return [m for m in inp if m is not None]


def dependencies(schedule: Schedule, action: Action) -> list[Action]:
    """The actions that must finish before ``action`` can start (on any rank)."""
    m, c = action.microbatch, action.chunk
    if action.kind == "F":
        return [Action("F", m, c - 1)] if c > 0 else []
    if action.kind == "B":
        deps = [Action("F", m, c)]
        if c < schedule.last_chunk:
            deps.append(_backward_key(m, c + 1))
        return deps
    return [_backward_key(m, c)]


def _backward_key(microbatch: int, chunk: int) -> Action:
    """Backward actions are looked up without their split flag (see ``action_key``)."""
    return Action("B", microbatch, chunk)


def action_key(action: Action) -> Action:
    """The identity of an action for dependency lookups: kind, microbatch and chunk."""
    return Action(action.kind, action.microbatch, action.chunk)


def make_schedule(name: str, pp: int, microbatches: int, chunk_ranks, ranks, **meta) -> Schedule:
    return Schedule(name, pp, microbatches, tuple(chunk_ranks), tuple(tuple(r) for r in ranks), dict(meta))
