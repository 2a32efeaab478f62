"""Simulate a schedule with per-action costs: start/end of each action, makespan, bubble, memory.

Each rank runs its actions in order; an action starts when the rank is free and its inputs have
arrived (a cross-rank input arrives ``p2p`` after its producer ends).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Action, Schedule, action_key, dependencies
from .validate import ScheduleError


@dataclass(frozen=True)
class Costs:
    """Durations in slots. ``full_backward`` is an unsplit B (one slot, the explainer's
    convention, unless given; ``parse_costs`` makes it b + w once b or w is set)."""

    f: float = 1.0
    b: float = 1.0  # input-grad B of a split backward
    w: float = 1.0
    full_backward: float | None = 1.0
    p2p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "p2p"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost {name}={getattr(self, name)} must be >= 0")
        if self.full_backward is not None and self.full_backward < 0:
            raise ValueError(f"cost full_backward={self.full_backward} must be >= 0")

    def duration(self, action: Action) -> float:
        if action.kind == "F":
            return self.f
        if action.kind == "W":
            return self.w
        if action.split:
            return self.b
        return self.b + self.w if self.full_backward is None else self.full_backward


def parse_costs(text: str) -> Costs:
    """``"f=1,b=2,w=1,p2p=0.5"`` (keys f, b, w, full, p2p); a full B costs b + w unless full= is given."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("f", "b", "w", "full", "p2p"):
            raise ValueError(f"bad cost {part!r}; write key=value with keys f, b, w, full, p2p (e.g. f=1,b=1,w=1)")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"cost {key}={value!r} is not a number") from None
    full = values.get("full")
    if full is None and not ("b" in values or "w" in values):
        full = 1.0
    return Costs(values.get("f", 1.0), values.get("b", 1.0), values.get("w", 1.0), full, values.get("p2p", 0.0))


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    costs: Costs
    ranks: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    bubble_fractions: tuple[float, ...]  # per rank: idle time / makespan
    peak_activations: tuple[int, ...]  # per rank: most (microbatch, chunk) forwards awaiting their B

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks (equal on every rank for gpipe and 1f1b)."""
        return sum(self.bubble_fractions) / len(self.bubble_fractions)

    def idle_time(self, rank: int) -> float:
        return self.makespan - sum(t.end - t.start for t in self.ranks[rank])


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    costs = costs or Costs()
    end: dict[Action, float] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(schedule.pp)]
    free = [0.0] * schedule.pp
    heads = [0] * schedule.pp
    remaining = sum(len(r) for r in schedule.ranks)
    while remaining:
        progressed = False
        for rank, row in enumerate(schedule.ranks):
            while heads[rank] < len(row):
                a = row[heads[rank]]
                deps = dependencies(schedule, a)
                if not all(d in end for d in deps):
                    break
                ready = [end[d] + (costs.p2p if schedule.chunk_ranks[d.chunk] != rank else 0.0) for d in deps]
                start = max([free[rank], *ready])
                free[rank] = start + costs.duration(a)
                end[action_key(a)] = free[rank]
                timed[rank].append(TimedAction(a, start, free[rank]))
                heads[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"{schedule.name}: deadlock in simulation at heads {heads}")
    makespan = max(free)
    busy = [sum(t.end - t.start for t in row) for row in timed]
    bubbles = tuple((makespan - b) / makespan if makespan > 0 else 0.0 for b in busy)
    return SimResult(schedule, costs, tuple(tuple(r) for r in timed), makespan, bubbles, tuple(_peak(r) for r in schedule.ranks))


def _peak(row) -> int:
    live = peak = 0
    for a in row:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
            live -= 1
    return peak
