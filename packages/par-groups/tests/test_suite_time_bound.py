"""No test waits without a bound: a hung test fails by itself, with the stacks of where it waits, and
the run goes on (pytest-timeout in signal mode, configured in the root pyproject.toml)."""

import signal
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

HUNG = '''
import time

def test_main_process_hangs():
    time.sleep(600)

def test_the_run_goes_on():
    assert True
'''


def hang_on_rank_1():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def test_the_suite_bounds_every_test_within_a_minute():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["timeout"] <= 60 and ini["timeout_method"] == "signal", ini


@pytest.mark.timeout(300)  # minutes under load on 2 cores: beyond the suite's 60 s bound
def test_a_planted_hang_fails_that_test_with_its_stacks_and_the_run_goes_on(pytester):
    pytester.makepyfile(test_hung=HUNG)
    # the root's bound and method, shortened: the same mechanism, in seconds, in the root's xdist workers
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "timeout=4", "-o", "timeout_method=signal",
                                           "-p", "no:randomly", "-n", "2", "--dist", "loadfile", timeout=300)
    result.assert_outcomes(failed=1, passed=1)
    out = result.stdout.str() + result.stderr.str()
    assert "Timeout (>4.0s)" in out and "time.sleep(600)" in out, out  # where the main process waited


def test_a_hung_rank_ended_by_the_bound_shows_its_stack_and_leaves_no_job_in_flight(dist_run, capfd):
    """The bound raises in the test's thread while it waits on the ranks: the harness prints each rank's
    stack and ends the pool, so the next test starts clean."""
    def bound(signum, frame):
        raise TimeoutError("the test's bound")

    assert dist_run(2, rank) == [0, 1]  # the pool is up: the bound below ends the job, not the start
    previous = signal.signal(signal.SIGALRM, bound)
    signal.setitimer(signal.ITIMER_REAL, 3)  # what pytest-timeout arms, shortened
    try:
        with pytest.raises(TimeoutError):
            dist_run(2, hang_on_rank_1, timeout=600)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    err = capfd.readouterr().err
    assert "--- rank 1 stacks ---" in err and "in hang_on_rank_1" in err, err
    assert not dist_run._pools[2]._procs  # killed and joined
    assert dist_run(2, rank) == [0, 1]


def rank():
    import torch.distributed as dist

    return dist.get_rank()
