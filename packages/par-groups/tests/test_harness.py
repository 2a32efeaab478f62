"""The multi-rank harness: results per rank, failures reported with the rank's traceback, hangs bounded."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from par_groups.testing import RankFailure


def rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def raise_on_rank(bad):
    if dist.get_rank() == bad:
        raise ValueError(f"boom from rank {bad}")
    dist.barrier()  # the healthy ranks would wait forever for the bad one
    return "unreachable"


def hang_on_rank(bad):
    if dist.get_rank() == bad:
        time.sleep(600)
    return dist.get_rank()


def tiny_job(x):
    return x + dist.get_rank()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_returns_its_result_after_a_collective(dist_run, world):
    total = world * (world + 1) / 2
    assert dist_run(world, rank_and_sum) == [(r, world, total) for r in range(world)]


def test_raising_rank_fails_with_its_traceback_and_no_hang(dist_run):
    with pytest.raises(RankFailure) as info:
        dist_run(4, raise_on_rank, 2, timeout=60)
    msg = str(info.value)
    assert "rank 2 raised" in msg and "ValueError: boom from rank 2" in msg
    assert "did not finish" not in msg  # the others were stopped at the raise, not at the 60 s timeout
    # The pool restarts cleanly afterwards.
    assert dist_run(4, tiny_job, 10) == [10, 11, 12, 13]


def test_hanging_rank_fails_after_the_timeout_and_leaves_no_process(dist_run):
    with pytest.raises(RankFailure, match=r"ranks \[1\] did not finish within 3 s") as info:  # the timeout ended it
        dist_run(2, hang_on_rank, 1, timeout=3)
    # where the hung rank waits: its stack, written by faulthandler on the harness's SIGUSR1
    assert "--- rank 1 stacks ---" in str(info.value) and "in hang_on_rank" in str(info.value), str(info.value)
    pool = dist_run._pools[2]
    assert not pool._procs  # killed and joined
    assert dist_run(2, tiny_job, 0) == [0, 1]


def worker_pid(i):
    return os.getpid()


def test_many_small_jobs_reuse_the_workers(dist_run):
    """The same worker processes serve every job (counted, not timed: a busy machine is slow, not wrong)."""
    pids = dist_run(4, worker_pid, 0)
    for i in range(20):
        assert dist_run(4, tiny_job, i) == [i, i + 1, i + 2, i + 3]
    assert dist_run(4, worker_pid, 1) == pids and len(set(pids)) == 4 and os.getpid() not in pids


def groups_left_in_a_cycle():
    """Make two subgroups, use them, and leave them held by a reference cycle (as a model's
    modules and hooks hold theirs); return this worker's thread count before that."""
    import gc
    import os

    gc.disable()  # so only the harness can collect the cycle (gc's own timing varies)
    threads = len(os.listdir("/proc/self/task"))
    holder = {"groups": [dist.new_group([0, 1]), dist.new_group([0, 1])]}
    holder["self"] = holder
    for g in holder["groups"]:
        dist.all_reduce(torch.ones(1), group=g)
    gc.enable()
    return threads


def test_groups_held_by_a_cycle_do_not_outlive_the_job(dist_run):
    # Each gloo group runs its own threads until the group object is freed. A job's cycles must be
    # collected before the next job, or every test leaves threads that wake and load the CPU.
    counts = [dist_run(2, groups_left_in_a_cycle)[0] for _ in range(4)]
    assert counts == [counts[0]] * 4, f"worker threads at the start of each job: {counts}"
