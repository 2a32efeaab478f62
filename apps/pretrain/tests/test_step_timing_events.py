"""Exposed communication timed from the collectives' own CUDA events (issue 47), proved on the CPU
with fake events (par_groups.testing.fake_events) through the seam ``CudaEventClock(event_class)``:
a step records its marks and an event pair per collective and reads nothing (no event read, no
host read of a tensor); the log step waits once and sums the pairs' elapsed times into
``time_exposed_comm_s``. A fake event recorded k-th stands at scale x k^2 ms, so every pair's time
differs and the expected sums below name the events they add up."""

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from par_groups import comm, fake_world
from par_groups.testing.fake_events import FakeEvents
from par_groups.watch import CommWatch
from pretrain.observe.step_timing import CudaEventClock, StepTimer

from host_reads import host_reads_counted

STEPS = 3  # the last is logged
PER_STEP = 8  # events a step records: start, all-reduce pair, data, all-gather pair, fwd_bwd, optimizer


def ms_between(scale: float, pairs) -> float:
    return sum(scale * (b * b - a * a) for a, b in pairs)


def expected(scale: float, base: int) -> dict:
    """The last step's parts in seconds, its events numbered from ``base + 1``."""
    start, data, fwd_bwd, opt = base + 1, base + 4, base + 7, base + 8
    comm_s = ms_between(scale, [(base + 2, base + 3), (base + 5, base + 6)]) / 1e3
    return {"time_data_s": ms_between(scale, [(start, data)]) / 1e3,
            "time_fwd_bwd_s": ms_between(scale, [(data, fwd_bwd)]) / 1e3,
            "time_optimizer_s": ms_between(scale, [(fwd_bwd, opt)]) / 1e3, "time_exposed_comm_s": comm_s}


def _as_cuda(watch, op, call, async_op):
    """``call`` run by the watch as the comm layer runs a call on CUDA tensors (these are CPU ones)."""
    return watch.run(watch.begin(op, None, 0), call, async_op, cuda=True)


def timed_steps():
    """STEPS steps of a timer over real gloo collectives timed as CUDA ones; rank r's device is r + 1 x slow."""
    rank = dist.get_rank()
    events = FakeEvents(scale_ms=1.0 + rank)
    reads = []
    with CommWatch(0) as watch, host_reads_counted() as count:
        timer = StepTimer(watch, torch.device("cpu"), clock=CudaEventClock(events))
        for step in range(STEPS):
            if step == STEPS - 1:  # between steps (an eval's collective): no step's
                _as_cuda(watch, "all_reduce", lambda: dist.all_reduce(torch.ones(2)), False)
            before = (count[0], events.reads)
            timer.start()
            x = torch.full((4,), float(rank))
            _as_cuda(watch, "all_reduce", lambda: dist.all_reduce(x), False)
            timer.lap("data")
            work = _as_cuda(watch, "all_gather", lambda: dist.all_gather_into_tensor(torch.empty(8), x, async_op=True),
                            True)
            work.wait()
            timer.lap("fwd_bwd")
            timer.lap("optimizer")
            timer.finish()
            reads.append((count[0] - before[0], events.reads - before[1]))
        record = timer.gathered()
    return reads, record, events.synchronized, len(events.recorded)


def test_a_step_reads_nothing_and_the_log_step_sums_the_collectives_events(dist_run):
    for rank, (reads, record, synchronized, recorded) in enumerate(dist_run(2, timed_steps)):
        assert reads == [(0, 0)] * STEPS, f"rank {rank}: (host reads, event reads) per step {reads}"
        assert synchronized == 1, "one wait for the device, at the log step"
        base = (STEPS - 1) * PER_STEP + 2  # the eval's pair before the last step
        assert recorded == base + PER_STEP
        mine = expected(1.0 + rank, base)
        for key, value in mine.items():
            assert abs(record[key] - value) < 1e-12, (rank, key, record[key], value)
        busy = [sum(expected(s, base)[f"time_{p}_s"] for p in ("data", "fwd_bwd", "optimizer"))
                - expected(s, base)["time_exposed_comm_s"] for s in (1.0, 2.0)]
        assert record["straggler_rank"] == 1 and abs(record["time_busy_max_s"] - busy[1]) < 1e-12
        assert abs(record["time_busy_median_s"] - busy[0]) < 1e-12  # torch's median of two: the lower


def test_fake_cuda_tensors_through_the_comm_layer_are_timed_by_events():
    """The tensors choose: fake CUDA tensors through ``par_groups.comm`` get event pairs, no host time."""
    events = FakeEvents()
    with fake_world(0, 2), FakeTensorMode(), CommWatch(0) as watch, host_reads_counted() as count:
        timer = StepTimer(watch, torch.device("cuda"), clock=CudaEventClock(events))
        for _ in range(STEPS):
            timer.start()
            x = torch.ones(4, device="cuda")
            comm.all_reduce(x, None)
            timer.lap("data")
            comm.all_gather_into_tensor(torch.empty(8, device="cuda"), x, None, async_op=True).wait()
            timer.lap("fwd_bwd")
            timer.lap("optimizer")
            timer.finish()
        assert (count[0], events.reads) == (0, 0)
        parts = timer.local()
    mine = expected(1.0, (STEPS - 1) * PER_STEP)
    assert events.synchronized == 1
    assert parts[:4] == pytest.approx([mine[f"time_{p}_s"] for p in ("data", "fwd_bwd", "optimizer", "exposed_comm")],
                                      abs=1e-12, rel=0)


def test_the_pipeline_bubble_on_cuda_is_the_schedules_point_to_point_waits_over_its_span():
    """Events per step: start 1, data 2 (the schedule's start), a send/recv batch's two works 3-4 and
    5-6, an all-reduce inside a chunk 7-8 (compute to the schedule), the schedule's end 9, 10, 11."""
    events = FakeEvents()
    with fake_world(0, 2), FakeTensorMode(), CommWatch(0) as watch, host_reads_counted() as count:
        timer = StepTimer(watch, torch.device("cuda"), clock=CudaEventClock(events))
        for _ in range(STEPS):
            timer.start()
            timer.lap("data")
            x = torch.ones(4, device="cuda")
            ops = [dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, torch.empty(4, device="cuda"), 1)]
            for work in comm.batch_isend_irecv(ops):
                work.wait()
            comm.all_reduce(x, None)
            timer.pipeline([], 0.0)
            timer.lap("fwd_bwd")
            timer.lap("optimizer")
            timer.finish()
        assert (count[0], events.reads) == (0, 0)
        parts = timer.local()
    b = (STEPS - 1) * 11
    p2p = ms_between(1.0, [(b + 3, b + 4), (b + 5, b + 6)])
    assert parts[3] == pytest.approx((p2p + ms_between(1.0, [(b + 7, b + 8)])) / 1e3, abs=1e-12, rel=0)
    assert parts[4] == pytest.approx(p2p / ms_between(1.0, [(b + 2, b + 9)]), abs=1e-12, rel=0)
