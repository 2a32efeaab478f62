"""Pipeline stage imbalance, reported apart from stragglers: the stages' busy times (each stage's median
rank over the straggler rule's window, ``stage_busy_s``) against the planner's per-stage time, which
is in proportion to the layers each stage holds (``planner.estimate``: the busiest stage sets the
pace). Every rank of a stage is slow alike here, so no rank is named: the split of the layers is.

The rule fires when the slowest stage is busy over ``MIN_RATIO`` times the least busy one's (once the
window is full); the event ``"event": "stage_imbalance"`` and one console line come when it starts
firing or its slowest stage changes, with the ratio the planner expects for the same two stages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MIN_RATIO = 1.5  # the slowest stage over 1.5x the least busy one


@dataclass(frozen=True)
class Imbalance:
    stage: int  # the slowest
    fastest: int
    ratio: float  # its busy time over the fastest's
    planned_ratio: float  # the same two stages' planned times (their layers)
    stage_busy_s: list
    planned_layers: list

    def line(self, step: int) -> str:
        beyond = "beyond" if self.ratio > MIN_RATIO * self.planned_ratio else "as"
        return (f"step {step}: stage imbalance: stage {self.stage} busy {self.ratio:.1f}x stage {self.fastest} "
                f"({beyond} planned: {self.planned_ratio:.1f}x by layers {'/'.join(map(str, self.planned_layers))}; "
                f"every rank of the stage alike, no straggler)")

    def event(self) -> dict:
        return asdict(self)


class StageBalance:
    """Kept by every rank with the straggler rule; ``planned_layers[stage]``: the layers on each stage."""

    def __init__(self, planned_layers: list[int] | None) -> None:
        self.planned = planned_layers
        self.firing: int | None = None  # the slowest stage while the rule fires

    def observe(self, stage_busy: list[float], full: bool) -> Imbalance | None:
        """The event if the rule starts firing (or names another stage) at this log step, else None."""
        slowest = max(range(len(stage_busy)), key=stage_busy.__getitem__)
        fastest = min(range(len(stage_busy)), key=stage_busy.__getitem__)
        low = stage_busy[fastest]
        fires = full and low > 0 and stage_busy[slowest] > MIN_RATIO * low
        if not fires:
            self.firing = None
            return None
        if self.firing == slowest:
            return None
        self.firing = slowest
        planned = self.planned if self.planned and len(self.planned) == len(stage_busy) else [1] * len(stage_busy)
        return Imbalance(slowest, fastest, round(stage_busy[slowest] / low, 3),
                         round(planned[slowest] / max(planned[fastest], 1), 3), list(stage_busy), list(planned))
