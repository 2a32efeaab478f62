"""`pretrain certify` and signals, as `train`: SIGTERM or Ctrl-C stops its ranks, one `error:` line,
exit 143 / 130, no process of it left (it used to ignore SIGTERM and run on to `certified`, exit 0,
and end two Ctrl-C with a traceback, exit 1). A real signal to a real certify process: SIGTERM while
the layout's ranks run (pretrain's launcher forwards it to them; Ctrl-C twice there too, in the
extended tier for its cost), and Ctrl-C twice while the one-rank reference runs (in the launcher's
own process: it used to end with no line)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CERTIFY = [sys.executable, "-m", "pretrain", "certify", "--nproc", "2", "--steps", "1", "--set", "parallel.tp=2",
           "--set", "model.layers=2"]
LIMIT_S = 300  # a bound on waiting, not a measurement


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(pid)
    return out


def _ranks(launcher: int) -> list[int]:
    """The launcher's descendants named ``pretrain-rankN``."""
    children, todo, found = _children(), [launcher], []
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                if Path(f"/proc/{pid}/comm").read_text().startswith("pretrain-rank"):
                    found.append(pid)
            except OSError:
                pass
    return found


def _wait_for(what, proc) -> object:
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        value = what()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"certify never got there (exit {proc.poll()}): {proc.communicate()}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _one_error_line(proc, code: int, name: str) -> None:
    out, err = proc.communicate(timeout=LIMIT_S)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], err
    assert "Traceback" not in out + err and "certified" not in out, (out, err)


@pytest.mark.timeout(LIMIT_S)  # a whole certify run up to its layout's ranks
@pytest.mark.parametrize("sig, times, code", [(signal.SIGTERM, 1, 143),
                                              pytest.param(signal.SIGINT, 2, 130, marks=pytest.mark.extended),
                                              pytest.param(signal.SIGHUP, 1, 129, marks=pytest.mark.extended)])
def test_a_signal_while_the_layouts_ranks_run_stops_them(tmp_path, sig, times, code):
    proc = subprocess.Popen(CERTIFY + ["--out", str(tmp_path / "c")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ranks = _wait_for(lambda: (tmp_path / "c" / "reference.pt").exists() and len(_ranks(proc.pid)) >= 2 and
                          _ranks(proc.pid), proc)
        for _ in range(times):
            os.kill(proc.pid, sig)
        _one_error_line(proc, code, sig.name)
        deadline = time.monotonic() + 10
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), ranks
        assert not (tmp_path / "c" / "report.json").exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(LIMIT_S)
def test_ctrl_c_twice_while_the_reference_runs_exit_130(tmp_path):
    proc = subprocess.Popen(CERTIFY + ["--out", str(tmp_path / "c")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for(lambda: (tmp_path / "c" / "checkpoints" / "manifest.json").exists(), proc)  # certify owns --out
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGINT)
        _one_error_line(proc, 130, "SIGINT")
    finally:
        proc.kill()
        proc.wait()
