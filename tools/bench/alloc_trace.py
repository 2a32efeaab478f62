"""Live tensor bytes of a trainer over its build and steps, counted from torch's CPU allocator.

``torch.profiler.profile(profile_memory=True)`` reports the allocations and frees made through
torch's CPU allocator while it is active, on the main thread and inside the collectives' works on
gloo's threads (its staging buffers included), each with the allocator's running total of live
bytes; with c10's ``caffe2_report_cpu_memory_usage`` flag on meanwhile, that total also drops for
the frees made outside the profiler (a gloo work's buffers freed by its thread once it ended). ``trace`` builds a trainer and runs a warm-up step and a few steps under it, in phases
(build, warmup, forward, backward, step: optimizer step + zero_grad); the live bytes are counted
over the baseline before the build, so the model state (params, grads, optimizer moments) is in,
the batch is not.

    t = trace(lambda: Runner(...), x, y, steps=2)
    t.peak          # the highest live bytes during the steps after the warm-up one
    t.peaks         # the highest per phase
    t.at, t.live    # the op running at that peak; the blocks then alive, biggest first
"""

from __future__ import annotations

import ctypes
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import profile, record_function

PHASES = ("build", "warmup", "forward", "backward", "step")
UNMEASURED = ("build", "warmup")  # one-time work: the build's transients, lazy init and state of the first step


@dataclass
class Trace:
    peaks: dict[str, int]  # per phase, bytes over the pre-build baseline
    peak: int  # over the steps after the warm-up (forward, backward, step)
    at: str  # phase/op of that peak
    live: list[tuple[int, str]]  # (bytes, phase/op that allocated it) of the blocks alive at that peak


@contextmanager
def _count_frees_on_every_thread():
    """Make the allocator's running total count the frees made on any thread, while inside.

    It updates the total only on threads where the profiler is on, or everywhere with c10's flag
    ``caffe2_report_cpu_memory_usage``. A gloo work's buffers are often freed by its worker thread
    after the work ends, outside the profiler: without the flag those frees never leave the total,
    and the peak counts blocks long gone (by up to 0.3 MB in bench_zero, varying with timing).
    With it, every free lowers the total that the next recorded event reports."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    old, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = old  # it also takes a lock (and formats a log line) at every allocation


def _walk(events, phase=None, op=None):
    """(event, phase, innermost op) of every event of the profiler's tree."""
    for e in events:
        p = e.name if e.name in PHASES else phase
        o = op if e.tag == _EventType.Allocation or e.name in PHASES else e.name
        yield e, p, o
        yield from _walk(e.children, p, o)


def _allocations(prof) -> list[tuple[int, object, str | None, str | None]]:
    """(time, allocation fields, phase, op) of every CPU allocation (size > 0) and free (< 0), in order."""
    tree = prof.profiler.kineto_results.experimental_event_tree()
    events = [(e.start_time_ns, e.extra_fields, phase, op) for e, phase, op in _walk(tree)
              if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    return sorted(events, key=lambda t: t[0])


def _step(r, x, y, phases=PHASES[2:]) -> None:
    with record_function(phases[0]):
        loss = nn.functional.mse_loss(r.dp(x), y)
    with record_function(phases[1]):
        loss.backward()
    with record_function(phases[2]):
        del loss
        (r.opt or r.dp).step()
        (r.opt or r.dp).zero_grad()


def trace(make_runner, x: torch.Tensor, y: torch.Tensor, steps: int = 2) -> Trace:
    """Build a trainer with ``make_runner()``, run a warm-up step and ``steps`` steps on (x, y) under the profiler.

    The runner has ``dp`` (callable, and ``step``/``zero_grad`` unless ``opt`` is set) and ``opt``."""
    gc.collect()
    with _count_frees_on_every_thread(), profile(profile_memory=True) as prof:
        with record_function("build"):
            r = make_runner()
        with record_function("warmup"):
            _step(r, x, y, ("fwd", "bwd", "opt"))
        for _ in range(steps):
            _step(r, x, y)
        del r
        gc.collect()
    events = _allocations(prof)
    base = events[0][1].total_allocated - events[0][1].alloc_size  # live bytes before the build
    peaks = {p: 0 for p in PHASES}
    top, top_i = (0, "-"), None
    current = None
    for i, (_, f, phase, op) in enumerate(events):
        live = f.total_allocated - base
        current = phase = phase or current  # a collective's thread: the main thread's phase then
        if phase in peaks:
            peaks[phase] = max(peaks[phase], live)
            if phase not in UNMEASURED and live > top[0]:
                top, top_i = (live, f"{phase}/{op}"), i
    return Trace(peaks, top[0], top[1], _live_at(events, top_i))


def _live_at(events, index: int | None) -> list[tuple[int, str]]:
    """The blocks alive right after event ``index``: (bytes, phase/op that allocated them), biggest first."""
    if index is None:
        return []
    live = {}  # by address: an allocation at a live one means its free went unrecorded (another thread)
    for _, f, phase, op in events[: index + 1]:
        if f.alloc_size > 0:
            live[f.ptr] = (f.alloc_size, f"{phase}/{op}")
        else:
            live.pop(f.ptr, None)
    return sorted(live.values(), reverse=True)
