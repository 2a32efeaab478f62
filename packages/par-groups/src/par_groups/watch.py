"""Watching the collectives: how long a rank waits in them, and a flight recorder of the last ones.

While a :class:`CommWatch` is active (``with watch:``, per thread like ``CommRecorder``), every
call through :mod:`par_groups.comm` is

* timed: a blocking call from entry to return, an asynchronous one (``async_op=True``, the
  point-to-point batches) inside its work's ``wait()``: the time this rank stood still waiting
  for a collective or a receive, not the time the transfer took in the background
  (:meth:`CommWatch.take_wait`). A call on CUDA tensors while ``device_events`` is set (the step
  timer sets it) is timed on the device instead: a pair of CUDA events recorded on the current
  (compute) stream around the call (a blocking NCCL call runs on that stream or makes it wait for
  NCCL's), or around an asynchronous call's ``wait()`` (where NCCL makes that stream wait for its
  side stream), kept unread (:meth:`CommWatch.take_events`; the step timer reads them at log
  steps): the time the compute stream stood in the collective. On CUDA
  the host returns from a NCCL launch at once, so a host clock there would time the launch;
* recorded into a ring of the last ``capacity`` entries: op, group (name and global ranks), the
  group's sequence number of the call on this rank, bytes, peer (point-to-point), times. Ranks
  that call the same collectives give one group's calls the same sequence numbers, so comparing
  the rings of all ranks shows which rank has not arrived at which call (``flight.summarize``);
* when it raises (gloo's timeout after ``timeout``), the ring and the Python stack are written to
  ``dump_path`` before the error goes on (:meth:`CommWatch.dump`);
* with ``ranges = True`` (a profiler window), a ``record_function`` range named
  ``comm.<op>[<group>]`` around it, so a trace shows each collective by group.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections import deque
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

_watch: ContextVar["CommWatch | None"] = ContextVar("par_comm_watch", default=None)

P2P = ("send", "recv")


@dataclass(slots=True)  # slots: one is made per collective, cheaply
class Entry:
    """One call: ``seq`` counts this rank's calls on ``group`` (1-based); ``end`` is None while in flight."""

    seq: int
    op: str
    group: str
    ranks: tuple[int, ...]
    bytes: int
    start: float  # time.time(): one clock for every process of a host
    peer: int | None = None  # point-to-point: the other global rank
    group_id: str = ""  # torch's name of the group (same on every rank): two groups of the same ranks differ
    end: float | None = None
    waiting_since: float | None = None  # an async call: when this rank began waiting for it
    pending: int = field(default=1, repr=False)  # works still to wait for

    @property
    def state(self) -> str:
        return "done" if self.end is not None else "waiting" if self.waiting_since is not None else "posted"


class _TimedWork:
    """A ``Work`` whose ``wait()`` is timed and closes its entry once its batch's last work is waited."""

    def __init__(self, work, watch: "CommWatch", entry: Entry, cuda: bool = False) -> None:
        self._work, self._watch, self._entry, self._done, self._cuda = work, watch, entry, False, cuda

    def wait(self, *args, **kwargs):
        if self._done:
            return self._work.wait(*args, **kwargs)
        entry, watch, t0 = self._entry, self._watch, time.perf_counter()
        entry.waiting_since = entry.waiting_since or time.time()
        first = watch.stamp(self._cuda)
        try:
            if watch.ranges:
                with watch.range(entry):
                    out = self._work.wait(*args, **kwargs)
            else:
                out = self._work.wait(*args, **kwargs)
        except Exception as e:
            watch.failed(entry, e)
            raise
        self._done = True
        watch.waited(t0, first, entry.op)
        entry.pending -= 1
        if entry.pending <= 0:
            entry.end = time.time()
        return out

    def __getattr__(self, name):  # is_completed, exception, get_future ... as the work has them
        return getattr(self._work, name)


class CommWatch:
    """Times and records every call through ``par_groups.comm`` while entered (see the module doc).

    ``names`` labels groups by their global ranks (e.g. ``{(0, 1): "tp"}``); others are named
    by torch's group name. ``dump_path``: where :meth:`dump` writes (None: nowhere)."""

    def __init__(self, capacity: int = 64, names: dict[tuple[int, ...], str] | None = None,
                 dump_path: str | Path | None = None) -> None:
        self.entries: deque[Entry] = deque(maxlen=capacity)
        self.names = dict(names or {})
        self.dump_path = None if dump_path is None else Path(dump_path)
        self.wait_s = 0.0  # total wait since the last take_wait()
        self.device_events = None  # an event class (torch.cuda.Event): CUDA calls are timed on the stream
        self.events: list[tuple] = []  # (op, start event, end event) since the last take_events()
        self.ranges = False
        self._seq: dict[str, int] = {}
        self._groups: dict[str, tuple[str, tuple[int, ...]]] = {}  # torch group name -> (label, ranks)

    def __enter__(self) -> "CommWatch":
        self._token = _watch.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _watch.reset(self._token)

    def name_groups(self, ranks_by_name: dict[str, tuple[int, ...]]) -> None:
        """Label groups by their global ranks (the first name given for a set of ranks wins)."""
        for name, ranks in ranks_by_name.items():
            self.names.setdefault(tuple(ranks), name)
        self._groups.clear()

    def take_wait(self) -> float:
        """Seconds waited in calls since the last take, and restart the count."""
        out, self.wait_s = self.wait_s, 0.0
        return out

    def take_events(self) -> list[tuple]:
        """``(op, start, end)`` of each CUDA call's event pair since the last take (none read here), and restart."""
        out, self.events = self.events, []
        return out

    def stamp(self, cuda: bool):
        """An event recorded on the current stream for a call on CUDA tensors while ``device_events`` is
        set; None otherwise (no event is made for CPU tensors: the tensors choose, never the watch)."""
        if not cuda or self.device_events is None:
            return None
        event = self.device_events(enable_timing=True)
        event.record()
        return event

    def waited(self, t0: float, first, op: str) -> None:
        """A call's wait is over: an event pair kept (nothing read) after :meth:`stamp`'s event, else host time."""
        if first is None:
            self.wait_s += time.perf_counter() - t0
        else:
            self.events.append((op, first, self.stamp(True)))

    # ---- called by par_groups.comm --------------------------------------------------------
    def _group(self, group) -> tuple[str, str, tuple[int, ...]]:
        group = group if group is not None else dist.group.WORLD
        key = group.group_name
        if key not in self._groups:
            ranks = tuple(dist.get_process_group_ranks(group))
            label = "world" if group is dist.group.WORLD else self.names.get(ranks, key)  # world: apart from a group of all ranks
            self._groups[key] = (label, ranks)
        return (key, *self._groups[key])

    def begin(self, op: str, group, nbytes: int, peer: int | None = None) -> Entry:
        key, label, ranks = self._group(group)
        if peer is not None:  # point-to-point: counted per peer and direction, apart from the group's collectives
            key = f"{key}/{op}/{peer}"
        seq = self._seq[key] = self._seq.get(key, 0) + 1
        entry = Entry(seq, op, label, ranks, int(nbytes), time.time(), peer, key)
        self.entries.append(entry)
        return entry

    @contextmanager
    def region(self, name: str, group=None):
        """One entry for a compiled region (``op`` = ``name``) whose collectives dynamo traced into its
        graph: a hang inside it shows the region in flight. Its time is compute, not a wait."""
        entry = self.begin(name, group, 0)
        try:
            yield entry
        except Exception as e:
            self.failed(entry, e)
            raise
        entry.end = time.time()

    def range(self, entry: Entry):
        """The profiler range of ``entry`` (used while ``ranges`` is on: in a profiler window)."""
        peer = "" if entry.peer is None else f"->{entry.peer}" if entry.op == "send" else f"<-{entry.peer}"
        return torch.profiler.record_function(f"comm.{entry.op}[{entry.group}]{peer}")

    def run(self, entry: Entry, call: Callable, async_op: bool, cuda: bool = False):
        """Run ``call`` (the torch collective) as ``entry``; wrap the work(s) it returns when asynchronous.
        ``cuda``: its tensors are CUDA tensors (timed by events while ``device_events`` is set)."""
        t0 = time.perf_counter()
        first = None if async_op else self.stamp(cuda)  # asynchronous: timed in its wait()
        try:
            if self.ranges:
                with self.range(entry):
                    out = call()
            else:  # no context manager per call outside a profiler window
                out = call()
        except Exception as e:
            self.failed(entry, e)
            raise
        if async_op:
            if isinstance(out, list):
                entry.pending = len(out)
                return [_TimedWork(w, self, entry, cuda) for w in out]
            return _TimedWork(out, self, entry, cuda)
        self.waited(t0, first, entry.op)
        entry.end = time.time()
        return out

    def failed(self, entry: Entry, error: BaseException) -> None:
        entry.waiting_since = entry.waiting_since or entry.start
        self.dump(f"{type(error).__name__}: {error}".splitlines()[0], in_flight=entry)

    # ---- the flight record ------------------------------------------------------------------
    def record(self, reason: str = "", in_flight: Entry | None = None, frame=None) -> dict:
        """This rank's flight record: the ring (oldest first), the call it is stuck in, the Python
        stack at ``frame`` (default: the caller's) and its innermost line (``where``)."""
        stack = traceback.extract_stack(frame or sys._getframe(1))
        last = stack[-1]
        return {"rank": dist.get_rank() if dist.is_initialized() else 0, "pid": os.getpid(), "time": time.time(),
                "reason": reason, "in_flight": None if in_flight is None else _as_dict(in_flight),
                "entries": [_as_dict(e) for e in self.entries], "stack": "".join(stack.format()),
                "where": f"{Path(last.filename).name}:{last.lineno} in {last.name}: {last.line}"}

    def dump(self, reason: str = "", in_flight: Entry | None = None, frame=None) -> Path | None:
        """Write :meth:`record` to ``dump_path`` (a new temporary name, then renamed: a symlink at either
        name is never written through); returns the path."""
        if self.dump_path is None:
            return None
        frame = frame or sys._getframe(1)
        self.dump_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dump_path.parent, prefix=f".{self.dump_path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.record(reason, in_flight, frame), indent=1))
            os.replace(tmp, self.dump_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.dump_path


def _as_dict(entry: Entry) -> dict:
    out = asdict(entry)
    out.pop("pending")
    out["state"] = entry.state
    return out


def active_watch() -> CommWatch | None:
    return _watch.get()
