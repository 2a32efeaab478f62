"""On CUDA tensors the watch times each call by a pair of events on the stream (issue 47): around a
blocking collective, around an asynchronous one's ``wait()`` (not its launch), nothing read when
they are made. Proved on fake CUDA tensors with fake events (par_groups.testing.fake_events), in a
fake world; CPU tensors keep host timing, and no event is made while ``device_events`` is unset."""

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from par_groups import comm, fake_world
from par_groups.testing.fake_events import FakeEvents
from par_groups.watch import CommWatch


def test_cuda_calls_are_event_pairs_around_the_wait_and_nothing_is_read():
    events = FakeEvents()
    with fake_world(0, 2), FakeTensorMode(), CommWatch(0) as watch:
        watch.device_events = events
        x = torch.ones(4, device="cuda")
        comm.all_reduce(x, None)  # blocking: events 1, 2
        work = comm.all_gather_into_tensor(torch.empty(8, device="cuda"), x, None, async_op=True)
        launched = len(events.recorded)
        work.wait()  # events 3, 4
        ops = [dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, torch.empty(4, device="cuda"), 1)]
        for w in comm.batch_isend_irecv(ops):  # one pair per work waited: 5-6, 7-8
            w.wait()
        comm.reduce_scatter_tensor(torch.empty(2, device="cuda"), x, None)  # 9, 10
        comm.all_to_all_single(torch.empty(4, device="cuda"), x, None)  # 11, 12
        pairs = watch.take_events()
        host_wait = watch.take_wait()
    assert launched == 2, "an asynchronous call's events are recorded at its wait(), not at its launch"
    assert [(a.index, b.index) for _, a, b in pairs] == [(2 * i + 1, 2 * i + 2) for i in range(6)]
    assert [op for op, _, _ in pairs] == ["all_reduce", "all_gather", "send", "send", "reduce_scatter", "all_to_all"]
    assert events.reads == 0 and host_wait == 0.0
    assert watch.take_events() == []  # taken: the next step starts empty


def test_cpu_tensors_and_an_unset_event_class_keep_host_timing():
    events = FakeEvents()
    with fake_world(0, 2), CommWatch(0) as watch:
        watch.device_events = events
        comm.all_reduce(torch.ones(3), None)  # a CPU tensor: the tensors choose, never the watch
        comm.all_gather_object([None, None], {"a": 1}, None)  # no tensor: host time
        with FakeTensorMode():
            watch.device_events = None  # timing off: no event even for CUDA tensors
            comm.all_reduce(torch.ones(3, device="cuda"), None)
        assert events.recorded == [] and watch.take_events() == []
        assert watch.take_wait() > 0.0  # the three host-timed calls
