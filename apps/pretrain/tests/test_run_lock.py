"""The run lock (issue 49, items 5 and 6, and the lock under races and after a SIGKILL).

- Without ``flock`` (Lustre ``noflock``, some NFS: ``flock`` fails with ENOLCK) a run still starts,
  locked by its ``pretrain.pid`` file alone, and a second run on the directory refuses in one line.
- A lock file another node's job left (host and job id in it) is refused in one line naming it and
  the file to delete once that job has ended; the same job id (a requeued job) takes it over.
- Processes racing for one directory: exactly one wins, with and without ``flock``.
- A holder killed with SIGKILL leaves ``pretrain.pid`` behind: the next run takes it over.
"""

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.errors import UsageError
from pretrain.training.preflight import PID_FILE, run_lock

runner = CliRunner()
TRAIN = ["train", "--nproc", "1", "--set", "model.layers=1", "--set", "train.steps=1", "--set", "train.warmup_steps=1",
         "--set", "train.eval_every=0", "--set", "log.progress=false"]
NO_FLOCK = "import fcntl, errno\ndef _no(*a):\n    raise OSError(errno.ENOLCK, 'No locks available')\nfcntl.flock = _no\n"


def _no_flock(monkeypatch):
    def refuse(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)


def test_without_flock_a_run_starts_and_a_second_one_refuses(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    res = runner.invoke(app, TRAIN + ["--set", f"log.dir={tmp_path / 'run'}"])
    assert res.exit_code == 0, res.output  # was: exit 1, "OSError: [Errno 37] No locks available"
    assert not (tmp_path / "run" / PID_FILE).exists()
    with run_lock(tmp_path / "run"):
        res = runner.invoke(app, TRAIN + ["--set", f"log.dir={tmp_path / 'run'}", "--force"])
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and f"in use by another run (PID {os.getpid()}" in lines[0], res.output


def test_a_lock_left_by_another_nodes_job_is_refused_and_the_same_job_takes_it_over(tmp_path, monkeypatch):
    log = tmp_path / "run"
    log.mkdir()
    theirs = json.dumps({"pid": 4242, "host": "node-b", "job": "SLURM_JOB_ID=17", "token": "x"}) + "\n"
    (log / PID_FILE).write_text(theirs)
    monkeypatch.setenv("SLURM_JOB_ID", "18")
    res = runner.invoke(app, TRAIN + ["--set", f"log.dir={log}"])
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert "(PID 4242 on node-b, job SLURM_JOB_ID=17)" in lines[0] and f"delete {log / PID_FILE}" in lines[0]
    assert (log / PID_FILE).read_text() == theirs and not (log / "log.jsonl").exists()
    monkeypatch.setenv("SLURM_JOB_ID", "17")  # the same job, requeued on this node
    res = runner.invoke(app, TRAIN + ["--set", f"log.dir={log}"])
    assert res.exit_code == 0 and not (log / PID_FILE).exists(), res.output


def test_a_run_arriving_while_the_lock_file_is_written_cannot_take_it(tmp_path, monkeypatch):
    """Without flock, a run that arrives between the lock file's creation and its contents must not
    read it empty, judge its holder gone and remove it: the file appears whole (test_racing_runs_one_wins
    once found two winners under load). Here the second run arrives at exactly that moment."""
    import pretrain.runtime.run_lock as module

    _no_flock(monkeypatch)
    arrivals = []

    def create_while_another_arrives(path, text):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # created, not yet written
        if not arrivals:  # once: the second run's own file is written at once
            arrivals.append("a second run arrives")
            try:
                with run_lock(tmp_path / "dir"):
                    arrivals.append("second run won")
            except UsageError:
                arrivals.append("second run refused")
        with os.fdopen(fd, "w") as f:
            f.write(text)

    monkeypatch.setattr(module, "create_new", create_while_another_arrives)
    with run_lock(tmp_path / "dir"):
        # the first run holds the lock, so its file is there and names it (a removed one: two holders)
        assert (tmp_path / "dir" / PID_FILE).exists(), arrivals
        assert json.loads((tmp_path / "dir" / PID_FILE).read_text())["pid"] == os.getpid()
    assert arrivals and not list((tmp_path / "dir").iterdir()), arrivals


def test_a_file_system_without_hard_links_still_locks(tmp_path, monkeypatch):
    """Some FUSE mounts refuse link(2): the lock file is then created and written in place."""
    def refuse(*args):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    with run_lock(tmp_path / "dir"):
        assert json.loads((tmp_path / "dir" / PID_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(UsageError, match="in use by another run"):
            with run_lock(tmp_path / "dir"):
                pass
    assert not list((tmp_path / "dir").iterdir())


RACER = """
import os, sys, time
from pathlib import Path
{patch}
from pretrain.errors import UsageError
from pretrain.training.preflight import run_lock
go = Path(sys.argv[2])
go.with_name(f"ready.{{os.getpid()}}").touch()  # imported: the test starts the race once all are
while not go.exists():
    time.sleep(0.001)
try:
    with run_lock(sys.argv[1]):
        print("won", flush=True)
        deadline = time.monotonic() + float(sys.argv[3])  # held until the test releases it (the losers are out)
        while not go.with_name("release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
except UsageError as e:
    print("lost", e, flush=True)
"""


def _wait_until(condition, bound_s: float = 120.0) -> None:
    """Polls ``condition``; the bound only keeps a broken run from hanging the suite (no timing is asserted)."""
    deadline = time.monotonic() + bound_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def _racers(tmp_path, n, patch):
    """``n`` processes take the lock at once (all imported first); the winner holds it until the
    others have given up, so a slow loser on a busy machine cannot arrive after the winner let go."""
    go = tmp_path / "go"
    script = textwrap.dedent(RACER.format(patch=patch))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "dir"), str(go), "600"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    _wait_until(lambda: len(list(tmp_path.glob("ready.*"))) == n)
    go.touch()
    _wait_until(lambda: sum(p.poll() is not None for p in procs) >= n - 1)  # two winners: none waits here
    (tmp_path / "release").touch()
    return [p.communicate(timeout=60) for p in procs]


@pytest.mark.parametrize("flock", ["flock", "no flock"])
def test_racing_runs_one_wins(tmp_path, flock):
    results = _racers(tmp_path, 6, "" if flock == "flock" else NO_FLOCK)
    outs = [out.strip() for out, err in results]
    assert all(not err for _, err in results), [err for _, err in results]
    assert sum(o == "won" for o in outs) == 1, outs
    assert all(o == "won" or (o.startswith("lost ") and "in use by another run" in o) for o in outs), outs
    assert not (tmp_path / "dir" / PID_FILE).exists() and not list((tmp_path / "dir").glob(".*stale"))


@pytest.mark.parametrize("flock", ["flock", "no flock"])
def test_a_holder_killed_with_sigkill_leaves_a_lock_the_next_run_takes_over(tmp_path, monkeypatch, flock):
    (tmp_path / "go").touch()  # no race: it takes the lock at once, and holds it
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(RACER.format(
        patch="" if flock == "flock" else NO_FLOCK)), str(tmp_path / "dir"), str(tmp_path / "go"), "600"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "won"
    if flock == "no flock":  # the file system has none: for every process on it
        _no_flock(monkeypatch)
    with pytest.raises(UsageError, match=f"in use by another run \\(PID {holder.pid}"):
        with run_lock(tmp_path / "dir"):
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert json.loads((tmp_path / "dir" / PID_FILE).read_text())["pid"] == holder.pid  # left behind
    with run_lock(tmp_path / "dir"):
        assert json.loads((tmp_path / "dir" / PID_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / "dir" / PID_FILE).exists()
