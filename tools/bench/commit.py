"""The commit a benchmark measured: ``git rev-parse --short HEAD``, plus "+dirty" if the tree has changes.

    from commit import measured_commit
    print(f"commit: {measured_commit()}")     # every bench prints this line first; run_all.py reads it
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def measured_commit() -> str:
    """The short HEAD hash, "+dirty" appended when tracked or untracked files differ from it."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=normal")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def print_commit() -> None:
    print(f"commit: {measured_commit()}", flush=True)
