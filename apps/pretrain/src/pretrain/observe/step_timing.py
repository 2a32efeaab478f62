"""Where a step's time goes (``[log] timing``, like Megatron's ``--timing-log-level``): measured on
every rank, compared across ranks at log steps.

Per rank: ``time_data_s`` (the batch and its CP shards), ``time_fwd_bwd_s`` (every micro-batch's
forward and backward, the pipeline schedule, the gradient reduction), ``time_optimizer_s``
(partial-gradient sums, clipping, the loss all-reduce, the optimizer step). These three are the
step. ``time_exposed_comm_s`` is the part of them this rank stood waiting in a collective or a
receive, measured by ``par_groups.watch`` around each call; ``pp_bubble`` is the share of the
pipeline schedule's time in which this rank ran no forward/backward (waiting for its inputs; the
log carries its mean over ranks).
On CUDA the phases are CUDA events recorded on the stream (no synchronize per phase: the GPU's
times, read at log steps only); on the CPU, host timestamps. So is the exposed communication: on
CUDA tensors the watch records an event pair on the compute stream around each collective (around
an asynchronous one's ``wait()``), kept unread in a per-step list, and this timer sums their
elapsed times at log steps, after one ``event.synchronize()`` of the step's last mark: the time the
compute stream stood in collectives (a blocking NCCL collective runs on the compute stream, or on
NCCL's side stream that the compute stream waits for: the pair brackets it either way; an
asynchronous one counts only from its ``wait()``, where the compute stream starts waiting for the
side stream, so the part that overlapped compute is not exposed). Calls on CPU tensors (gloo) are
host-timed. The bubble on the CPU
is host timestamps of the schedule's actions; on CUDA it is the share of the schedule's time on the
stream (events at its start and end) that the stream stood in its sends' and receives' waits.

Across ranks (one small all-gather over all ranks, at log steps only): ``time_busy_s`` is a rank's
step less its exposed communication; its median over ranks, its maximum and that rank
(``straggler_rank``) find the rank the others wait for. Rank 0 logs its own parts and these.

Per phase too (``BUSY_PHASES``): the forward calls and the pipeline's sends are spans of their own
(:meth:`StepTimer.span`) inside the forward-backward phase, whose remainder is the backward; each
call's wait counts to the phase or span it falls in, so a phase's busy time is its time less its
own waits. These rows go, with each rank's pipeline stage, to ``pretrain.observe.stragglers``,
which compares ranks only with the ranks that do the same work.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from contextlib import contextmanager, nullcontext

from par_groups import comm
from par_groups.watch import P2P

from .stragglers import BUSY_PHASES, StragglerRule

PHASES = ("data", "fwd_bwd", "optimizer")
AFTER = {"data": "backward", "fwd_bwd": "optimizer", "optimizer": None}  # the phase a lap starts


class HostClock:
    """Marks are host timestamps."""

    def mark(self) -> float:
        return time.perf_counter()

    @staticmethod
    def settle(last: float) -> None:
        pass

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """Marks are CUDA events recorded on the current stream, read once :meth:`settle` waited for the
    step's last one (``event_class``: the seam a test fills with a fake event)."""

    def __init__(self, event_class=None) -> None:
        self.event_class = event_class or torch.cuda.Event

    def mark(self):
        event = self.event_class(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def settle(last) -> None:
        last.synchronize()  # every event recorded on the stream before it is complete too

    @staticmethod
    def seconds(start, end) -> float:
        return start.elapsed_time(end) / 1e3  # ms


class StepTimer:
    """Marks one rank's phases (:meth:`start`, :meth:`lap`, :meth:`finish`); :meth:`gathered` (every
    rank, at log steps) reads the last step's and compares them across ranks."""

    def __init__(self, watch, device: torch.device, clock=None) -> None:
        self.watch, self.device = watch, device
        self.clock = clock or (CudaEventClock() if device.type == "cuda" else HostClock())
        watch.device_events = getattr(self.clock, "event_class", None)  # the watch's calls on CUDA tensors
        self.marks: list = []
        self.bubble = 0.0
        self.last: tuple | None = None  # the last finished step: (marks, waits, spans, bubble)
        self.stage = 0  # this rank's pipeline stage (the Trainer sets it): ranks are compared within one
        self.planned_layers: list[int] | None = None  # each stage's layers (the Trainer sets them): the planned split
        self.rule: StragglerRule | None = None  # made at the first log step (every rank's stage and host)
        self.current: str | None = None  # the phase running now (None between steps)
        self.waits: dict = {}
        self.spans: dict = {}

    def start(self) -> None:
        self.bubble = 0.0
        self.watch.take_wait()
        self.watch.take_events()  # calls between steps (eval, the log step's gather) are no step's
        self.waits = {p: [0.0, []] for p in BUSY_PHASES}  # per phase: host-timed wait, CUDA event pairs
        self.spans = {"forward": [], "pp_send": []}
        self.current = "data"
        self.marks = [self.clock.mark()]

    def _bank(self, phase: str) -> None:
        """The waits since the last bank are ``phase``'s."""
        wait = self.waits[phase]
        wait[0] += self.watch.take_wait()
        wait[1] += self.watch.take_events()

    def lap(self, phase: str) -> None:
        if self.current is not None:
            self._bank(self.current)
        self.current = AFTER[phase]
        self.marks.append(self.clock.mark())

    @contextmanager
    def span(self, name: str):
        """A forward call or a pipeline send (``name``): its time and waits are its own, not the phase's."""
        outer = self.current
        if outer is None or outer == name:  # between steps (evaluation), or nested in itself
            yield
            return
        self._bank(outer)
        self.current, start = name, self.clock.mark()
        try:
            yield
        finally:
            self._bank(name)
            self.spans[name].append((start, self.clock.mark()))
            self.current = outer

    def pipeline(self, records, seconds: float) -> None:
        """The schedule ran ``seconds``; ``records`` are its actions (start once the inputs arrived)."""
        if self.device.type == "cuda":  # read at log steps: from the data mark (the schedule's start) to now
            self.bubble = (self.marks[-1], self.clock.mark())
            return
        busy = sum(r.end - r.start for r in records)
        self.bubble = max(0.0, 1.0 - busy / seconds) if seconds > 0 else 0.0

    def finish(self) -> dict:
        """Keep this step's marks; nothing is read or gathered here (see :meth:`gathered`)."""
        if self.current is not None:
            self._bank(self.current)
        self.current = None
        self.last = (self.marks, self.waits, self.spans, self.bubble)
        return {}

    def local(self) -> list[float]:
        """The last step's parts on this rank, read now: the phases' seconds, the exposed comm, the bubble,
        then the busy seconds of each of ``BUSY_PHASES``."""
        marks, waits, spans, bubble = self.last
        seconds = self.clock.seconds
        self.clock.settle(marks[-1])  # the one wait for the device, at log steps only
        times = [seconds(a, b) for a, b in zip(marks, marks[1:])]
        times += [0.0] * (len(PHASES) - len(times))
        waited = {p: w + sum(seconds(a, b) for _, a, b in events) for p, (w, events) in waits.items()}
        spent = {name: sum(seconds(a, b) for a, b in pairs) for name, pairs in spans.items()}
        wait = sum(waited.values())
        if isinstance(bubble, tuple):  # CUDA: the schedule's waits in sends and receives over its span
            span = seconds(*bubble)
            p2p = sum(seconds(a, b) for w in waits.values() for op, a, b in w[1] if op in P2P)
            bubble = min(1.0, p2p / span) if span > 0 else 0.0
        phase = {"data": times[0], "forward": spent["forward"], "pp_send": spent["pp_send"],
                 "backward": times[1] - spent["forward"] - spent["pp_send"], "optimizer": times[2]}
        busy = [max(0.0, phase[p] - waited[p]) for p in BUSY_PHASES]
        return times + [wait, bubble] + busy

    def gathered(self) -> dict:
        """The last step's parts on this rank and the cross-rank median / slowest (every rank calls it)."""
        mine = self.local()
        wait, bubble = mine[3:5]
        local = torch.tensor(mine, dtype=torch.float64, device=self.device)
        every = torch.empty(dist.get_world_size() * local.numel(), dtype=torch.float64, device=self.device)
        comm.all_gather_into_tensor(every, local, None)
        rows = every.view(-1, local.numel()).cpu()
        busy = rows[:, :3].sum(1) - rows[:, 3]
        slowest = int(busy.argmax())
        out = {f"time_{p}_s": mine[i] for i, p in enumerate(PHASES)}
        out |= {"time_exposed_comm_s": wait, "time_busy_median_s": float(busy.median()),
                "time_busy_max_s": float(busy[slowest]), "straggler_rank": slowest,
                "time_busy_by_rank_s": [round(b, 6) for b in busy.tolist()]}
        if bubble or rows[:, 4].any():
            # the mean over ranks, the share of the pipeline's device-time idle (the simulator's bubble):
            # stages differ by design (the first waits for gradients, the last for activations), and the
            # median of two stages would be the less idle one's
            out["pp_bubble"] = float(rows[:, 4].mean())
        if self.rule is None or len(self.rule.stages) != len(rows):  # once, and again after a regroup
            self.rule = StragglerRule.gathered(self.stage, self.device, self.planned_layers)  # every rank's stage, host, GPU
        return out | self.rule.observe(rows[:, 5:])


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

    @staticmethod
    def span(name: str):
        return nullcontext()

    def gathered(self) -> dict:
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
