"""``[profile] steps = "20-22"``: a torch.profiler Chrome trace of each of those steps, on every rank
(``every = N``: also of steps N, 2N, ..., as torchtitan's ``profile_freq``).

Each step of the window writes ``<log.dir>/profile/step_N/rank_R.json`` (open it in Perfetto or
chrome://tracing). The trace names what ran: par-pp's executor wraps each pipeline action in a
``record_function`` range (``F3.c1`` = forward of micro-batch 3 on chunk 1, ``B``, ``W``), and
``par_groups.watch`` each collective (``comm.all_reduce[dp]``, ``comm.recv[pp]<-2``). With
``memory = true``: on CUDA a memory snapshot of the window, ``profile/memory/rank_R.pickle``
(``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``; drop it on
https://pytorch.org/memory_viz); on the CPU the profiler's memory columns, per operator,
``step_N/rank_R_memory.txt`` (and memory events in the trace).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ..runtime.safe_files import write_via

MEMORY_EVENTS = 100_000  # allocation events the CUDA history keeps
# Kineto's notes on stderr at every start and stop, whatever KINETO_LOG_LEVEL says:
# "USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:39] profiler_start" (and STAGE: lines)
KINETO_NOTE = re.compile(rb"^(USDT|STAGE):\S+ \S+ \S+ \S+\.cpp:\d+\] ")


class ProfileWindow:
    """Call :meth:`before` and :meth:`after` around each step (1-based numbers)."""

    def __init__(self, cfg, rank: int, device: torch.device, watch=None) -> None:
        self.window, self.profile = cfg.profile.window(), cfg.profile
        self.memory, self.rank, self.device, self.watch = cfg.profile.memory, rank, device, watch
        self.dir = Path(cfg.log.dir) / "profile"
        self._prof = None

    def _in_window(self, step: int) -> bool:
        return self.profile.traces(step)

    def _first_of_window(self, step: int) -> bool:
        return self.window is not None and step == self.window[0]

    def before(self, step: int) -> None:
        if not self._in_window(step):
            return
        cuda = self.device.type == "cuda"
        if cuda and self.memory and self._first_of_window(step):
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no "gpuGetDeviceCount failed" line per rank on a CPU host
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(activities=activities, profile_memory=self.memory and not cuda)
        _without_kineto_notes(self._prof.start)
        if self.watch is not None:
            self.watch.ranges = True

    def after(self, step: int) -> None:
        if self._prof is None:
            return
        _without_kineto_notes(self._prof.stop)
        out = self.dir / f"step_{step}"
        out.mkdir(parents=True, exist_ok=True)
        _write(out / f"rank_{self.rank}.json", self._prof.export_chrome_trace)
        if self.memory and self.device.type != "cuda":
            table = self._prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=25)
            _write(out / f"rank_{self.rank}_memory.txt", lambda p: Path(p).write_text(table))
        self._prof = None
        if self.window is not None and step == self.window[1]:
            if self.watch is not None:
                self.watch.ranges = False
            if self.memory and self.device.type == "cuda":
                (self.dir / "memory").mkdir(parents=True, exist_ok=True)
                _write(self.dir / "memory" / f"rank_{self.rank}.pickle", torch.cuda.memory._dump_snapshot)
                torch.cuda.memory._record_memory_history(enabled=None)


def _write(path: Path, writer) -> None:
    """``writer(name)`` to a temporary name, then renamed (no half-written file under the real name)."""
    write_via(path, writer)


def _without_kineto_notes(call) -> None:
    """``call()`` with the C++ stderr (fd 2) caught, then written back without Kineto's notes."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            call()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = b"".join(line for line in caught if not KINETO_NOTE.match(line))
            if rest:
                os.write(2, rest)
