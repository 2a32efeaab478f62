"""Which rank is slow, and does it matter: the straggler rule over the busy times gathered at log steps.

Each rank's busy time per phase (``BUSY_PHASES``: its time in the phase less its own waits in
collectives and receives, see ``step_timing``) is kept over the last ``WINDOW`` log steps. A rank is
compared only with its peers, the ranks of the same pipeline stage (the same chunks: the same work,
across dp, tp, cp and ep); stages differ in work by design, and their medians are reported apart
(``stage_busy_s``, and the ``stage_balance`` rule on them). For each phase, a rank's value is its
median over the window (a one-off stall does not move it); its peers' baseline is the median of the
other ranks' values, their spread the MAD. The rule fires when the rank exceeds the baseline by more
than all of: ``MADS`` scaled MADs, ``MIN_RELATIVE`` of the baseline, and ``MIN_SHARE`` of the peers' whole busy step (a phase too small to matter does
not fire); a rank that fires in several phases is named once, in the phase where it lost the most.
A rank that fires at ``CHRONIC`` log steps in a row is chronic.
"""

from __future__ import annotations

import socket
import statistics
from collections import deque
from dataclasses import asdict, dataclass

import torch
from par_groups import comm

from .stage_balance import StageBalance

BUSY_PHASES = ("data", "forward", "backward", "optimizer", "pp_send")
WINDOW = 5  # log steps kept per rank
MIN_SAMPLES = WINDOW  # a full window before the rule may fire (the first steps warm up)
MADS = 5.0
MIN_RELATIVE = 2.0  # the rank is over 3x its peers in the phase (ranks descheduled on a shared machine jitter by 2x)
MIN_SHARE = 0.25  # and the excess is at least this share of the peers' busy step (less does not matter)
CHRONIC = 3  # log steps in a row
LEAVE_ONE_OUT = 8  # up to this many peers, each rank is compared with the others; above, with all (one outlier barely moves a median)


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    gpu: str
    stage: int
    phase: str
    busy_s: float  # the rank's median over the window
    peers_s: float  # its peers' median
    slower: float | None  # busy_s / peers_s (None: the peers spent nothing in the phase)
    chronic: bool

    def line(self, step: int) -> str:
        chronic = ", chronic" if self.chronic else ""
        return (f"step {step}: straggler rank {self.rank} (host {self.host}, GPU {self.gpu}, stage {self.stage}): "
                f"{self.phase} {1e3 * self.busy_s:.0f} ms, {self.slower or float('inf'):.1f}x its peers' "
                f"{1e3 * self.peers_s:.0f} ms"
                f"{chronic}")

    def event(self) -> dict:
        return asdict(self)


def _median(values) -> float:
    return statistics.median(values) if values else 0.0


class StragglerRule:
    """The rule over every rank's rows, kept by every rank (rank 0 logs what it finds)."""

    def __init__(self, stages: list[int], hosts: list[str] | None = None, gpus: list[str] | None = None,
                 window: int = WINDOW, planned_layers: list[int] | None = None) -> None:
        self.stages = stages
        self.balance = StageBalance(planned_layers)  # the stages against each other: apart from stragglers
        self.hosts = hosts or ["?"] * len(stages)
        self.gpus = gpus or ["?"] * len(stages)
        self.history: deque = deque(maxlen=window)
        self.streak: dict[tuple[int, str], int] = {}
        self.groups: dict[int, list[int]] = {}
        for rank, stage in enumerate(stages):
            self.groups.setdefault(stage, []).append(rank)

    @classmethod
    def gathered(cls, stage: int, device: torch.device, planned_layers: list[int] | None = None) -> "StragglerRule":
        """Every rank's stage, host and GPU, gathered once (at the first log step)."""
        import torch.distributed as dist

        gpu = f"{device.index if device.index is not None else torch.cuda.current_device()}" \
            if device.type == "cuda" else device.type
        mine = (stage, socket.gethostname(), gpu)
        every: list = [None] * dist.get_world_size()
        comm.all_gather_object(every, mine, None)
        stages, hosts, gpus = (list(column) for column in zip(*every))
        return cls(stages, hosts, gpus, planned_layers=planned_layers)

    def observe(self, busy: torch.Tensor) -> dict:
        """``busy[rank, phase]`` of the last step: the log record's ``stragglers`` (and ``stage_busy_s``
        under pipeline parallelism)."""
        self.history.append(busy.tolist())
        per_rank = [[_median([h[r][p] for h in self.history]) for p in range(len(BUSY_PHASES))]
                    for r in range(len(self.stages))]
        out: dict = {}
        if len(self.groups) > 1:  # each stage's median rank, whole busy step: the pipeline's imbalance
            out["stage_busy_s"] = [round(_median([sum(per_rank[r]) for r in self.groups[s]]), 6)
                                   for s in sorted(self.groups)]
            imbalance = self.balance.observe(out["stage_busy_s"], len(self.history) >= MIN_SAMPLES)
            if imbalance is not None:
                out["stage_imbalance"] = [imbalance]
        flags = self.flags(per_rank) if len(self.history) >= MIN_SAMPLES else []
        fired = {(f.rank, f.phase) for f in flags}
        self.streak = {key: self.streak.get(key, 0) + 1 for key in fired}
        out["stragglers"] = [Straggler(**{**asdict(f), "chronic": self.streak[(f.rank, f.phase)] >= CHRONIC})
                             for f in flags]
        return out

    def flags(self, per_rank: list[list[float]]) -> list[Straggler]:
        """Each rank that fires, in the phase where it lost the most time (a slow device slows its
        other phases too: the one line names where the time went)."""
        worst: dict[int, tuple] = {}
        for stage, ranks in self.groups.items():
            if len(ranks) < 2:
                continue  # no peer does this work
            for p, phase in enumerate(BUSY_PHASES):
                whole = _peers(per_rank, ranks, p) if len(ranks) > LEAVE_ONE_OUT else None
                for rank in ranks:
                    base, mad, step = whole or _peers(per_rank, [r for r in ranks if r != rank], p)
                    mine = per_rank[rank][p]
                    excess = mine - base
                    if excess > max(MADS * mad, MIN_RELATIVE * base, MIN_SHARE * step) and excess > worst.get(rank, (0,))[0]:
                        worst[rank] = (excess, Straggler(rank, self.hosts[rank], self.gpus[rank], stage, phase, mine,
                                                         base, mine / base if base > 0 else None, False))
        return [worst[rank][1] for rank in sorted(worst)]


def _peers(per_rank: list[list[float]], ranks: list[int], p: int) -> tuple[float, float, float]:
    """The median of ``ranks``' phase ``p``, its scaled MAD, and their median whole busy step."""
    values = [per_rank[r][p] for r in ranks]
    base = _median(values)
    return base, 1.4826 * _median([abs(v - base) for v in values]), _median([sum(per_rank[r]) for r in ranks])
