"""The parallel degrees of a world, one type for every place that needs them (as torchtitan's ParallelDims).

tp, cp, pp, ep and expert tp are given; data parallel (dp) and expert data parallel (edp) are what
the world leaves, derived here once. ``RankGrid`` (the groups), the trainer's resolved ``Layout`` and
the planner's ``Shape`` are each these degrees plus what they add.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None: tp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        """Dense data parallel: the ranks left over tp x cp x pp."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks left over expert tp x ep x pp."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)
