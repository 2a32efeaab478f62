"""Faults while saving: a full disk is named as such and its partial ``step_N.tmp`` removed.

DCP reports a rank's write error inside a ``CheckpointException`` (``failures``: rank -> the
exception), so the ENOSPC may sit a few levels down; :func:`disk_full` looks through them. torch's
zip writer loses the errno altogether: a short write becomes ``RuntimeError: ... unexpected pos``
(a regular file takes a short write only when the space runs out), which counts as full too. Every
rank sees the same DCP failure, so they all decide alike. Failing both, the filesystem itself is
asked (:func:`cannot_write_here` tries 1 MiB).
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import UsageError

SHORT_WRITE = "unexpected pos"  # torch's zip writer (inline_container.cc) when fewer bytes were written than given


def disk_full(error: BaseException) -> bool:
    """True when ``error`` is, wraps or was caused by ENOSPC (or a quota), or is torch's short write."""
    stack, seen = [error], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, RuntimeError) and SHORT_WRITE in str(e):
            return True
        if isinstance(e, tuple):
            stack += [x for x in e if isinstance(x, BaseException)]
            continue
        stack += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
    return False


PROBE_BYTES = 1 << 20


def cannot_write_here(directory: Path) -> bool:
    """True when ``directory``'s filesystem refuses ``PROBE_BYTES`` more with ENOSPC (probe removed)."""
    probe = Path(directory) / f".space-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as e:
        return e.errno == errno.ENOSPC
    try:
        left = memoryview(bytes(PROBE_BYTES))
        while left:  # a write near the end of the space is short; the next one raises ENOSPC
            left = left[os.write(fd, left):]
        os.fsync(fd)
        return False
    except OSError as e:
        return e.errno == errno.ENOSPC
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


@contextmanager
def removed_if_disk_full(tmp: Path):
    """Run a save into ``tmp``; on ENOSPC remove ``tmp`` (it would keep the disk full) and say so."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if not (disk_full(e) or cannot_write_here(tmp.parent)):
            if isinstance(e, CheckpointException):  # else the launcher records no message for it
                raise RuntimeError(f"writing checkpoint {tmp} failed: {first_failure(e)}") from e
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"disk full (ENOSPC) while writing checkpoint {tmp} (removed); free space on that "
                         f"filesystem, lower [checkpoint].keep or choose another [checkpoint].dir") from None


def first_failure(error: BaseException) -> str:
    """One line for ``error``; DCP's CheckpointException (every rank's traceback) by its first rank's error."""
    failures = sorted(getattr(error, "failures", {}).items())
    prefix = f"rank {failures[0][0]}: " if failures else ""
    if failures:
        error = failures[0][1][0] if isinstance(failures[0][1], tuple) else failures[0][1]
    lines = str(error).strip().splitlines()
    return f"{prefix}{type(error).__name__}: {lines[0] if lines else ''}"
