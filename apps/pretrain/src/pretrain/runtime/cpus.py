"""The CPUs this process may use."""

from __future__ import annotations

import os


def cores() -> int:
    """The CPUs this process may run on (its affinity: a cgroup or taskset may grant fewer than the host has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
