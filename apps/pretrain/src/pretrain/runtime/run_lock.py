"""One run per ``[log].dir`` and per checkpoint directory, on one host or across nodes.

Each directory gets two locks, taken by the launcher (under torchrun: global rank 0):

- ``flock`` on the directory itself: released by the kernel when the process dies, so a crashed or
  SIGKILLed run never leaves it behind. It covers the processes of one host (and of every host on a
  file system whose locks are cluster-wide: NFSv4, Lustre mounted ``-o flock``). Where ``flock`` is
  not available at all (Lustre ``noflock``, some NFS mounts) only the lock file below is used.
- ``pretrain.pid``, written whole under a temporary name and hard-linked into place (atomic on a
  shared file system, never through a symlink, never seen empty): the holder's PID, host and job id
  (``SLURM_JOB_ID``, or torchrun's ``TORCHELASTIC_RUN_ID``). A job on another node finds it and refuses. A lock file left behind
  by a run that died without removing it is taken over when its holder is known to be gone: on this
  host, when this process got the ``flock`` (the holder would hold it) or, without ``flock``, when
  its PID is not alive; on another host only by the same job id (a requeued or restarted job).
  Otherwise the error names the holder and the file to delete once that job has ended.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ..errors import UsageError
from .safe_files import create_new
from .strict_json import loads

PID_FILE = "pretrain.pid"
TAKEOVER_TRIES = 5
MAX_PID = 2**31  # a PID at or above it names no process (and os.kill could not take it)
NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)


def job_id() -> str | None:
    """The scheduler's id of this job, shared by its restarts; None outside one."""
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(key, "")
        if value and value != "none":
            return f"{key}={value}"
    return None


@contextmanager
def run_lock(*dirs: str | Path):
    """Hold the lock of each of ``dirs`` (log and checkpoint directory) for the run; a live run
    holding one is a UsageError naming it."""
    with ExitStack() as stack:
        for path in dict.fromkeys(Path(d).resolve() for d in dirs):  # the same directory twice: one lock
            stack.enter_context(_lock_dir(path))
        yield


@contextmanager
def _lock_dir(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        flocked = _flock(fd, path)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "job": job_id(), "token": uuid.uuid4().hex}
        _take_file(path / PID_FILE, me, flocked)
        try:
            yield
        finally:
            if _holder(path / PID_FILE).get("token") == me["token"]:
                (path / PID_FILE).unlink(missing_ok=True)
    finally:
        os.close(fd)


def _flock(fd: int, path: Path) -> bool:
    """True if this process now holds the directory's flock; False where the file system has none."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        raise _in_use(path, _holder(path / PID_FILE)) from None
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.EBADF):
            return False  # no flock here: the lock file alone
        raise UsageError(f"cannot lock {path} ({e.strerror or e})") from None


def _take_file(file: Path, me: dict, flocked: bool) -> None:
    text = json.dumps(me) + "\n"
    for _ in range(TAKEOVER_TRIES):
        try:
            _publish(file, text)
            return
        except FileExistsError:
            pass
        if file.is_symlink() or not file.is_file():
            raise UsageError(f"{file} is a symlink or not a file, not a lock pretrain wrote; remove it (nothing "
                             f"is written through it)")
        holder = _holder(file)
        if not _gone(holder, me, flocked):
            raise _in_use(file.parent, holder)
        _remove_if_unchanged(file, holder)
    raise UsageError(f"{file} keeps changing: another run is starting on {file.parent}; wait for it, or choose "
                     f"another --set log.dir / checkpoint.dir")


def _publish(file: Path, text: str) -> None:
    """Create ``file`` holding ``text``, whole from the moment it exists: a hard link to a written
    temporary file (FileExistsError if the name is taken; atomic on NFS and Lustre too). Created and
    then written, a racer could read it empty, judge its holder gone and remove it: two winners."""
    temporary = file.with_name(f".{file.name}.{uuid.uuid4().hex}.new")
    create_new(temporary, text)
    try:
        os.link(temporary, file)
    except OSError as e:
        if e.errno not in NO_HARD_LINKS:
            raise
        create_new(file, text)  # a file system without hard links: created, then written, as before
    finally:
        os.unlink(temporary)


def _gone(holder: dict, me: dict, flocked: bool) -> bool:
    """Whether the run that wrote ``holder`` is known to have ended (so its lock file is stale)."""
    if holder.get("job") is not None and holder.get("job") == me["job"]:
        return True  # this job's own earlier attempt (a requeue or restart)
    if holder.get("host") not in (None, me["host"]):
        return False  # another node: its PID cannot be checked from here
    if flocked:
        return True  # the holder would still hold the directory's flock
    if holder.get("unreadable"):
        return False  # without flock, a lock file we cannot read may be a live run's
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _remove_if_unchanged(file: Path, holder: dict) -> None:
    """Move the stale lock aside (atomic: one taker wins), delete it if it is the one judged stale, else put it back."""
    aside = file.with_name(f".{file.name}.{uuid.uuid4().hex}.stale")
    try:
        os.rename(file, aside)
    except FileNotFoundError:
        return  # another taker moved it first
    if _holder(aside) != holder:  # a new holder's lock: put it back
        try:
            os.link(aside, file)
        except OSError:
            pass
    os.unlink(aside)


def _holder(file: Path) -> dict:
    """What a lock file says: {} unless it is a regular file (never read through a symlink, never waiting
    on a FIFO); legacy files hold only a PID. Each field is kept only when it is what a run writes."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except PermissionError:
        return {"pid": None, "unreadable": True}  # another user's: who holds it cannot be told
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return {}
        with os.fdopen(fd, "rb") as f:
            raw = f.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return {}
    try:
        data = loads(raw)
    except ValueError:
        data = int(raw) if raw.isascii() and raw.isdigit() else None  # a legacy bare PID
    if isinstance(data, int) and not isinstance(data, bool):
        data = {"pid": data}
    if not isinstance(data, dict):
        return {"pid": None}
    pid = data.get("pid")
    holder = {"pid": pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < MAX_PID else None}
    return holder | {k: data[k] for k in ("host", "job", "token") if isinstance(data.get(k), str)}


def _in_use(path: Path, holder: dict) -> UsageError:
    who = f"PID {holder.get('pid', '?')}" if not holder.get("unreadable") else f"{PID_FILE} is not readable by us"
    if holder.get("host"):
        who += f" on {holder['host']}"
    if holder.get("job"):
        who += f", job {holder['job']}"
    hint = (f"; if that run has ended (killed without cleanup), delete {path / PID_FILE}"
            if holder.get("host") not in (None, socket.gethostname()) or holder.get("unreadable") else "")
    return UsageError(f"{path} is in use by another run ({who}); wait for it to end, or choose another "
                      f"--set log.dir / checkpoint.dir{hint}")
