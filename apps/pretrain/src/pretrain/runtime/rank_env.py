"""What a standalone rank and its launcher share: the environment variable naming the launcher, the
rendezvous store's keys, and the two ways a run ends early (:class:`RankFailed`, :class:`Aborted`).

Its own module so the launcher (``launch.py``, ``local_launcher.py``) and the ranks' side (``preempt.py``)
read them from one place without importing each other.
"""

from __future__ import annotations

LAUNCHER_ENV = "PRETRAIN_LAUNCHER"  # the pid of the process that started this rank (set by pretrain's launcher)


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
