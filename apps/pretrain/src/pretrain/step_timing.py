"""Where a step's time goes (``[log] timing``, like Megatron's ``--timing-log-level``): measured on
every rank, compared across ranks once per step.

Per rank: ``time_data_s`` (the batch and its CP shards), ``time_fwd_bwd_s`` (every micro-batch's
forward and backward, the pipeline schedule, the gradient reduction), ``time_optimizer_s``
(partial-gradient sums, clipping, the loss all-reduce, the optimizer step). These three are the
step. ``time_exposed_comm_s`` is the part of them this rank stood waiting in a collective or a
receive, measured by ``par_groups.watch`` around each call; ``pp_bubble`` is the share of the
pipeline schedule's time in which this rank ran no forward/backward (waiting for its inputs). On
CUDA each phase ends with a device synchronize, so the times are the GPU's, not the launch queue's.

Across ranks (one small all-gather over all ranks per step): ``time_busy_s`` is a rank's step less
its exposed communication; its median over ranks, its maximum and that rank (``straggler_rank``)
find the rank the others wait for. Rank 0 logs its own parts and these.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from par_groups import comm

PHASES = ("data", "fwd_bwd", "optimizer")


class StepTimer:
    """Times one rank's phases (:meth:`start`, :meth:`lap`) and gathers them (:meth:`finish`)."""

    def __init__(self, watch, device: torch.device) -> None:
        self.watch, self.device = watch, device
        self.times: dict[str, float] = {}
        self.bubble = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.times, self.bubble = {}, 0.0
        self.watch.take_wait()
        self._last = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.times[phase] = now - self._last
        self._last = now

    def pipeline(self, records, seconds: float) -> None:
        """The schedule ran ``seconds``; ``records`` are its actions (start once the inputs arrived)."""
        busy = sum(r.end - r.start for r in records)
        self.bubble = max(0.0, 1.0 - busy / seconds) if seconds > 0 else 0.0

    def finish(self) -> dict:
        """This rank's parts and the cross-rank median / slowest (every rank calls it)."""
        wait = self.watch.take_wait()
        mine = [self.times.get(p, 0.0) for p in PHASES] + [wait, self.bubble]
        local = torch.tensor(mine, dtype=torch.float64, device=self.device)
        every = torch.empty(dist.get_world_size() * local.numel(), dtype=torch.float64, device=self.device)
        comm.all_gather_into_tensor(every, local, None)
        rows = every.view(-1, local.numel()).cpu()
        busy = rows[:, :3].sum(1) - rows[:, 3]
        slowest = int(busy.argmax())
        out = {f"time_{p}_s": mine[i] for i, p in enumerate(PHASES)}
        out |= {"time_exposed_comm_s": wait, "time_busy_median_s": float(busy.median()),
                "time_busy_max_s": float(busy[slowest]), "straggler_rank": slowest}
        if self.bubble or rows[:, 4].any():
            out["pp_bubble"] = float(rows[:, 4].median())  # the median rank's share
        return out


class NoTimer:
    """What a Trainer uses without ``[log] timing``: nothing measured, nothing gathered."""

    def start(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def pipeline(self, records, seconds: float) -> None:
        pass

    def finish(self) -> dict:
        return {}


def format_timing(record: dict) -> str:
    """The console's compact breakdown: ``data 1 | fwd-bwd 120 (comm 30, bubble 12%) | opt 10 ms | slowest r3 150 ms (median 100)``."""
    if "time_fwd_bwd_s" not in record:
        return ""

    def ms(key: str) -> str:
        return f"{1e3 * record[key]:.0f}"

    inner = f"comm {ms('time_exposed_comm_s')}"
    if "pp_bubble" in record:
        inner += f", bubble {100 * record['pp_bubble']:.0f}%"
    return (f"data {ms('time_data_s')} | fwd-bwd {ms('time_fwd_bwd_s')} ({inner}) | opt {ms('time_optimizer_s')} ms"
            f" | slowest r{record['straggler_rank']} {ms('time_busy_max_s')} ms (median {ms('time_busy_median_s')})")
