"""For the whole suite: SIGTERM (as `timeout` or a CI runner sends it) or SIGINT ends the run
promptly with pytest's summary, wherever it is. pytest itself handles only SIGINT; here both raise
KeyboardInterrupt and mark the session to stop after the current test, so code under test that
catches the interrupt (a CLI invoked in-process) cannot keep the run going. A test that launches
ranks in-process hands the signal back here once its ranks stop (``pretrain.runtime.local_launcher``). A process
forked from pytest (a multiprocessing pool of a command under test) gets the default action back:
it dies as it would outside the suite."""

import os
import signal


def pytest_sessionstart(session):
    pytest_pid = os.getpid()

    def interrupted(signum, frame):
        if os.getpid() != pytest_pid:  # a forked child inherited this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        session.shouldstop = f"{signal.Signals(signum).name} received"
        raise KeyboardInterrupt(session.shouldstop)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, interrupted)

pytest_plugins = ("pytester",)  # a test runs a planted-hang session of its own (test_suite_time_bound.py)
