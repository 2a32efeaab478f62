"""`pretrain train` started in a process group of its own, hurt from outside, and what it left running.

Shared by the fault tests here and ``tools/faults.py``. Ranks are the forkserver's children; the
forkserver and multiprocessing's resource tracker are the launcher's; all share the launcher's
process group, so the group's members are every process of the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def start(log_dir: Path, *overrides: str, nproc: int = 2, prelude: str = "") -> subprocess.Popen:
    """``pretrain train --nproc N`` (after ``prelude``, Python run first in the launcher: a fault to inject)."""
    args = [a for o in overrides for a in ("--set", o)]
    code = f"{prelude}\nfrom pretrain.cli import main; import sys; sys.argv = ['pretrain'] + sys.argv[1:]; main()"
    return subprocess.Popen([sys.executable, "-c", code, "train", "--nproc", str(nproc), "--set", f"log.dir={log_dir}",
                             *args], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def members(pgid: int) -> list[tuple[int, int, str, str]]:
    """(pid, ppid, state, command line) of every process in group ``pgid`` (from /proc), zombies (exited,
    not yet reaped) left out."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue  # not a process, or it just ended
        state, ppid, group = stat[stat.rindex(")") + 2:].split()[:3]  # the fields after "(comm)"
        if int(group) == pgid and state != "Z":
            out.append((int(entry.name), int(ppid), state, cmd))
    return out


def rank_pids(launcher: int) -> list[int]:
    """The ranks of the run: children of the launcher's forkserver, in start order (rank order)."""
    forked = [(pid, ppid) for pid, ppid, _, cmd in members(launcher) if "multiprocessing.forkserver" in cmd]
    return sorted(pid for pid, ppid in forked if ppid in {p for p, _ in forked})  # the server's children


def wait_for_steps(log_dir: Path, steps: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until the run's log.jsonl has ``steps`` loss lines (or the run ended)."""
    log, deadline = Path(log_dir) / "log.jsonl", time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and sum('"loss"' in line for line in log.read_text().splitlines()) >= steps:
            return
        time.sleep(0.1)
    why = proc.stderr.read() if proc.poll() is not None else "still running"
    raise AssertionError(f"the run did not log {steps} steps (exit {proc.poll()}): {why}")


def finish(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[int, str, list, float]:
    """Wait for the launcher: (exit code, stderr, the group's processes still running 5 s after, seconds until
    the group was empty)."""
    _, err = proc.communicate(timeout=timeout_s)
    exited = time.monotonic()
    left = members(proc.pid)
    while left and time.monotonic() - exited < 5.0:
        time.sleep(0.05)
        left = members(proc.pid)
    return proc.returncode, err, left, time.monotonic() - exited


def losses(log_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(log_dir) / "log.jsonl").read_text().splitlines())
            if "loss" in r}


def kill_group(proc: subprocess.Popen) -> None:
    """Test clean-up: whatever of this run still runs (it is our own process group)."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
