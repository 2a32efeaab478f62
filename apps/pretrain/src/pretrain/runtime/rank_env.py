"""What a standalone rank and its launcher share: the environment variable naming the launcher, the
rendezvous store's keys, the signals that stop a run (and what a closed terminal leaves to fix), and
the two ways a run ends early (:class:`RankFailed`, :class:`Aborted`).

Its own module so the launcher (``launch.py``, ``local_launcher.py``) and the ranks' side (``preempt.py``)
read them from one place without importing each other.
"""

from __future__ import annotations

import errno
import os
import signal

LAUNCHER_ENV = "PRETRAIN_LAUNCHER"  # the pid of the process that started this rank (set by pretrain's launcher)
# Each asks for a checkpoint at the next step boundary, then a clean exit. SIGHUP: the terminal was
# closed or the ssh session dropped (the kernel sends it to every process of the run; torchrun
# forwards it to its ranks as it is).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def off_a_closed_terminal() -> None:
    """Point stdout and stderr at /dev/null where writing to them fails with EIO (the terminal they were
    is gone, as after a SIGHUP), so no print between the signal and the exit ends the run without its
    checkpoint. Anything else (a live terminal, a pipe, a file) is left as it is."""
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError as e:
            if e.errno != errno.EIO:
                continue
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)


class RankFailed(RuntimeError):
    """A rank raised, died or did not join; ``rank`` is the first failing global rank, ``error`` its message.

    ``usage`` is true when the rank raised a :class:`UsageError` (the user's to fix)."""

    def __init__(self, rank: int, error: str, exitcode: int | None = None, traceback: str = "", usage: bool = False):
        self.rank, self.error, self.exitcode, self.traceback, self.usage = rank, error, exitcode, traceback, usage
        super().__init__(f"rank {rank} failed: {error}")


class Aborted(RuntimeError):
    """The run was stopped from outside without a clean save (a second Ctrl-C, or the pre-emption
    deadline passed); ``exit_code`` is what the command line exits with."""

    def __init__(self, message: str, exit_code: int = 1):
        self.exit_code = exit_code
        super().__init__(message)


def join_key(stage: str, rank: int) -> str:
    """Store key a standalone rank sets when it reaches (``arrived``) and completes (``joined``) the rendezvous."""
    return f"pretrain/{stage}/{rank}"
