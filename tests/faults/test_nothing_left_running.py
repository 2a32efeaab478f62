"""Nothing of a run is left running after its launcher exits (issue 38): a rank SIGKILLed mid-step
ends the run with one line naming it, and within 5 s no process of the run's process group remains
(the forkserver, the resource tracker and the other rank included). The other exits (success, a
user's error, SIGTERM, SIGINT twice, a SIGSTOPped rank) are checked the same way by tools/faults.py."""

import os
import signal

import pytest

from run_group import finish, kill_group, members, rank_pids, start, wait_for_steps

RUN = ("model.layers=2", "train.steps=100000", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
       "train.collective_timeout_s=600")


@pytest.mark.timeout(300)  # a whole `pretrain train` in its own process
def test_a_rank_killed_mid_step_leaves_no_process_of_the_run(tmp_path):
    proc = start(tmp_path, *RUN)
    try:
        wait_for_steps(tmp_path, 2, proc)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, (ranks, members(proc.pid))
        os.kill(ranks[1], signal.SIGKILL)
        code, err, left, took = finish(proc)
    finally:
        kill_group(proc)
    assert code == 1 and err == "error: rank 1 failed: exited with code -9 (signal SIGKILL)\n", err
    assert left == [], f"still running {took:.1f} s after the launcher exited: {left}"
