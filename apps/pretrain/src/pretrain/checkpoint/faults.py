"""Faults while saving: a full disk is named as such and its partial ``step_N.tmp`` removed.

DCP reports a rank's write error inside a ``CheckpointException`` (``failures``: rank -> the
exception), so the ENOSPC may sit a few levels down; :func:`disk_full` looks through them.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import UsageError

KILL_ENV = "PRETRAIN_KILL_IN_SAVE"  # "RANK:STEP": that rank SIGKILLs itself mid-save of that step; for fault tests


def disk_full(error: BaseException) -> bool:
    """True when ``error`` is, wraps or was caused by ENOSPC."""
    stack, seen = [error], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if isinstance(e, tuple):
            stack += [x for x in e if isinstance(x, BaseException)]
            continue
        stack += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
    return False


@contextmanager
def removed_if_disk_full(tmp: Path):
    """Run a save into ``tmp``; on ENOSPC remove ``tmp`` (it would keep the disk full) and say so."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if not disk_full(e):
            if isinstance(e, CheckpointException):  # else the launcher records no message for it
                raise RuntimeError(f"writing checkpoint {tmp} failed: {_first_failure(e)}") from e
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"disk full (ENOSPC) while writing checkpoint {tmp} (removed); free space on that "
                         f"filesystem, lower [checkpoint].keep or choose another [checkpoint].dir") from None


def _first_failure(error) -> str:
    for rank, (exc, _) in sorted(error.failures.items()):
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return str(error)


def injected_kill(rank: int, step: int) -> None:
    """Die by SIGKILL here when ``PRETRAIN_KILL_IN_SAVE`` names this rank and step (fault-injection tests)."""
    if os.environ.get(KILL_ENV) == f"{rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
