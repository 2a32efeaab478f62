"""`pretrain certify --out DIR` owns DIR as `train` owns a run directory: pointed at a run's log.dir
(or its checkpoint directory), live (a real `train`, frozen by SIGSTOP while certify runs) or
stopped, it refuses in one line, exit 2, and every file of the run is byte-identical afterwards (it
used to save its narrowed reference there under the run's id, replace ``step_2``, prune the run's
other saves and point ``latest`` at its own model). Its own earlier output is reused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

from one_error_line import assert_one_error_line, snapshot

runner = CliRunner()
LIMIT_S = 300  # a bound on waiting for the live run's checkpoints, not a measurement
CERTIFY = ["certify", "--nproc", "2", "--steps", "1", "--set", "parallel.tp=2", "--set", "model.layers=2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A stopped run: three checkpoints (step_2, step_4, step_6), its manifest and ``latest``."""
    log = tmp_path_factory.mktemp("certify_out") / "run"
    res = runner.invoke(app, ["train", "--nproc", "1", "--set", "model.layers=1", "--set", "train.steps=6",
                              "--set", "train.warmup_steps=1", "--set", "train.eval_every=0", "--set", "log.progress=false",
                              "--set", "checkpoint.every=2", "--set", "checkpoint.keep=3", "--set", f"log.dir={log}"])
    assert res.exit_code == 0, res.output
    assert {"step_2", "step_4", "step_6", "latest", "manifest.json"} <= {p.name for p in (log / "checkpoints").iterdir()}
    return log


@pytest.mark.timeout(LIMIT_S)  # the first one trains the run
@pytest.mark.parametrize("where", ["log.dir", "checkpoint dir"])
def test_certify_refuses_a_stopped_runs_directory(run_dir, where):
    out = run_dir if where == "log.dir" else run_dir / "checkpoints"
    before = snapshot(run_dir)
    res = runner.invoke(app, CERTIFY + ["--out", str(out)])
    assert_one_error_line(res, where, "another run's checkpoints")
    assert snapshot(run_dir) == before


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A live `pretrain train` that has saved checkpoints, frozen (SIGSTOP: alive, its lock held, its
    files still) while certify is pointed at it; killed afterwards."""
    log = tmp_path_factory.mktemp("certify_live") / "run"
    proc = subprocess.Popen([sys.executable, "-m", "pretrain", "train", "--nproc", "1", "--set", "model.layers=1",
                             "--set", "train.steps=100000", "--set", "train.eval_every=0", "--set", "log.progress=false",
                             "--set", "checkpoint.every=1", "--set", "checkpoint.keep=3", "--set", f"log.dir={log}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + LIMIT_S
        while not (log / "checkpoints" / "step_2").is_dir() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None and (log / "checkpoints" / "step_2").is_dir()
        os.kill(proc.pid, signal.SIGSTOP)  # a save or prune in flight is frozen too: its files stay as they are
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.05)
        yield log, proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(LIMIT_S)  # the first one starts the live run
@pytest.mark.parametrize("where", ["log.dir", "checkpoint dir"])
def test_certify_refuses_a_live_runs_directory(live_run, where):
    log, pid = live_run
    before = snapshot(log)
    res = runner.invoke(app, CERTIFY + ["--out", str(log if where == "log.dir" else log / "checkpoints")])
    assert_one_error_line(res, where, f"in use by another run (PID {pid}")
    assert snapshot(log) == before


def test_certify_reuses_its_own_output_and_refuses_a_run_that_has_not_saved_yet(tmp_path):
    """Its checkpoint directory carries a ``certify-`` run id: a second certify there goes on; a
    manifest of a run (no save yet: its id would become certify's) is refused."""
    from pretrain.certify.output import owned
    from pretrain.errors import UsageError

    work = tmp_path / "c"
    with owned(work):
        manifest = json.loads((work / "checkpoints" / "manifest.json").read_text())
    assert manifest["run_id"].startswith("certify-")
    (work / "checkpoints" / "step_0").mkdir()
    (work / "checkpoints" / "step_0" / "trainer_state.json").write_text(json.dumps({"run_id": manifest["run_id"]}))
    (work / "checkpoints" / "latest").write_text("step_0\n")
    with owned(work):
        pass
    assert json.loads((work / "checkpoints" / "manifest.json").read_text()) == manifest
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"run_id": "0123456789ab", "saves": []}))
    with pytest.raises(UsageError, match="another run's checkpoints"):
        with owned(tmp_path / "run"):
            pass
