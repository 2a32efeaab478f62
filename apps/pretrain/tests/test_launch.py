"""Standalone launch: N local ranks with the torchrun environment, started safely whatever threads
the caller runs; the store listens on the master address only; a raising rank ends all promptly; a
rank that does not join in time is named."""

import gc
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pretrain.runtime.launch import RankFailed, check_nproc, launch
from pretrain.errors import UsageError

ENTRIES = '''
import os, threading, time
import torch
import torch.distributed as dist
from pretrain.runtime.launch import init_distributed, shutdown

LOCK = threading.Lock()  # the test holds it in a thread of its own while ranks start

def listening(port):
    """Addresses (hex, as /proc/net shows them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:
                    found.append(address)
    return found

def report(scale):
    rank, world, local_rank, device = init_distributed(timeout_s=60)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out = (rank, world, local_rank, str(device), t.item() * scale, listening(int(os.environ["MASTER_PORT"])))
    shutdown()
    return out

def report_after_lock(scale):
    with LOCK:  # a forked rank would inherit it held by a thread that does not exist there: a hang
        pass
    return report(scale)

def late_rank(seconds):
    if os.environ["RANK"] == "1":
        time.sleep(seconds)
    return report(1.0)

def names():
    init_distributed(timeout_s=60)
    with open("/proc/self/comm") as f:
        out = (os.environ["RANK"], f.read().strip())
    shutdown()
    return out

def one_rank_fails(stamp):
    rank, *_ = init_distributed(timeout_s=600)
    if rank == 1:
        time.sleep(0.5)
        with open(stamp, "w") as f:
            f.write(str(time.time()))
        raise ValueError("boom from rank 1")
    dist.barrier()  # would wait for the collective timeout (600 s) if the launcher did not stop it
'''


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    root = tmp_path_factory.mktemp("entries")
    (root / "launch_entries.py").write_text(textwrap.dedent(ENTRIES))
    sys.path.insert(0, str(root))  # spawned ranks inherit sys.path
    import launch_entries

    yield launch_entries
    sys.path.remove(str(root))


LOOPBACK = "0100007F"  # 127.0.0.1 in /proc/net/tcp


def test_standalone_ranks_see_the_torchrun_environment_and_the_store_listens_on_the_master_address_only(entries):
    out = launch(entries.report, (2.0,), nproc=2)
    assert out == [(0, 2, 0, "cpu", 6.0, [LOOPBACK]), (1, 2, 1, "cpu", 6.0, [LOOPBACK])]
    assert launch(entries.report, (1.0,), nproc=1) == [(0, 1, 0, "cpu", 1.0, [])]  # one rank: nothing listens


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process name is Linux's /proc/PID/comm")
def test_each_rank_process_is_named_after_its_rank(entries):  # issue 50: nothing told which PID was which rank
    assert launch(entries.names, (), nproc=2) == [("0", "pretrain-rank0"), ("1", "pretrain-rank1")]


def _churn(stop: threading.Event) -> None:
    while not stop.is_set():  # allocate and collect, as a program's worker threads do
        [object() for _ in range(1000)]
        gc.collect()
        time.sleep(0.001)  # leave the ranks some CPU


def test_ranks_start_safely_while_the_caller_runs_threads(entries):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(256, 256) @ torch.ones(256, 256)  # torch's intra-op pool is up
    stop, locked = threading.Event(), threading.Event()

    def hold_lock():
        with entries.LOCK:
            locked.set()
            stop.wait()

    try:
        with ThreadPoolExecutor(4) as pool:
            pool.submit(hold_lock)
            churners = [pool.submit(_churn, stop) for _ in range(2)]
            locked.wait()
            try:
                out = launch(entries.report_after_lock, (1.0,), nproc=4)
            finally:
                stop.set()
            [c.result() for c in churners]
    finally:
        torch.set_num_threads(threads)
    assert [r[4] for r in out] == [10.0] * 4


def test_a_rank_that_does_not_join_in_time_is_named(entries):
    with pytest.raises(RankFailed) as e:  # before rank 0's own 60 s rendezvous timeout, and rank 1's 600 s sleep
        launch(entries.late_rank, (600,), nproc=2, join_timeout_s=4)
    assert str(e.value) == "rank 1 failed: did not reach the rendezvous within 4 s ([train].join_timeout_s)"


def test_a_raising_rank_ends_every_rank_within_seconds_with_its_error(entries, tmp_path):
    stamp = tmp_path / "raised_at"
    with pytest.raises(RankFailed) as e:
        launch(entries.one_rank_fails, (str(stamp),), nproc=2)
    assert time.time() - float(stamp.read_text()) < 15  # rank 0 was stopped, not left in its barrier
    assert e.value.rank == 1 and str(e.value) == "rank 1 failed: ValueError: boom from rank 1"
    assert "launch_entries.py" in e.value.traceback


@pytest.mark.parametrize("nproc, message", [(0, "must be >= 1"), (65, "more than 64")])
def test_nproc_limits(nproc, message):
    with pytest.raises(UsageError, match=message):
        check_nproc(nproc, device="cpu")


def test_cpu_threads_honour_omp_num_threads_else_share_this_process_cores(monkeypatch):
    """A CPU rank's torch threads: OMP_NUM_THREADS as set (torchrun sets 1 beside other ranks; a user may
    set more), else the cores this process may use (its affinity) over the host's local ranks."""
    from pretrain.runtime.launch import cpu_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert cpu_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}) == 1
    assert cpu_threads({"OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "2"}) == 5
    assert cpu_threads({"LOCAL_WORLD_SIZE": "2"}) == 3  # 6 usable cores, not os.cpu_count()
    assert cpu_threads({"LOCAL_WORLD_SIZE": "8"}) == 1
    assert cpu_threads({"OMP_NUM_THREADS": "", "LOCAL_WORLD_SIZE": "3"}) == 2
