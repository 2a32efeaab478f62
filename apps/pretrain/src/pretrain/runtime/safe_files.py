"""Files a run creates in ``[log].dir`` and the checkpoint directory, never through a symlink.

A symlink standing at one of our names (``pretrain.pid``, ``log.jsonl``, ``error.log``, a flight
record, ``latest``...) must not make the run write into the file it points to. Every file is
written under a fresh temporary name (``mkstemp``: ``O_CREAT | O_EXCL``, which refuses any existing
name, a symlink included) and renamed over its real name: a rename replaces the symlink itself, not
its target. A file kept open for appending (``log.jsonl``) stays open on that temporary file's
descriptor after the rename, so it is never opened by name again.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, TextIO


def _temp(path: Path) -> tuple[int, str]:
    return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")


def fresh_temp(path: str | Path) -> Path:
    """A new empty file next to ``path`` (created exclusively, so never through a symlink), for a writer that
    renames several files into place together; it gets the permissions a plain ``open`` would give."""
    fd, tmp = _temp(Path(path))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
    finally:
        os.close(fd)
    return Path(tmp)


def write_atomic(path: str | Path, data: str | bytes, fsync: bool = True) -> None:
    """``data`` under a temporary sibling name (fsync'd), then renamed over ``path``."""
    path = Path(path)
    fd, tmp = _temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def write_via(path: str | Path, writer: Callable[[str], object]) -> None:
    """``writer(name)`` writes a temporary sibling (ours, just created), then it is renamed over ``path``."""
    path = Path(path)
    fd, tmp = _temp(path)
    os.close(fd)
    try:
        writer(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def replace_for_append(path: str | Path, text: str) -> TextIO:
    """``path`` replaced by a new file holding ``text``, returned open for appending (line-buffered)."""
    path = Path(path)
    fd, tmp = _temp(path)
    f = os.fdopen(fd, "w", buffering=1)
    try:
        f.write(text)
        os.replace(tmp, path)
    except BaseException:
        f.close()
        _remove(tmp)
        raise
    return f


def create_new(path: str | Path, text: str) -> None:
    """Create ``path`` holding ``text``; FileExistsError if any entry (a symlink too) has that name."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass
