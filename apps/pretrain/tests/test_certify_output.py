"""`pretrain certify --out DIR` owns DIR as `train` owns a run directory: pointed at a run's log.dir
(or its checkpoint directory), live or stopped, it refuses in one line, exit 2, and every file of the
run is byte-identical afterwards (it used to save its narrowed reference there under the run's id,
replace ``step_2``, prune the run's other saves and point ``latest`` at its own model). Its own
earlier output is reused; a path that is no writable directory is one line too."""

import json
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

from one_error_line import assert_one_error_line, snapshot

runner = CliRunner()
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


@pytest.mark.parametrize("where", ["log.dir", "checkpoint dir"])
def test_certify_refuses_a_stopped_runs_directory(run_dir, where):
    out = run_dir if where == "log.dir" else run_dir / "checkpoints"
    before = snapshot(run_dir)
    res = runner.invoke(app, CERTIFY + ["--out", str(out)])
    assert_one_error_line(res, where, "another run's checkpoints")
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("where", ["log.dir", "checkpoint dir"])
def test_certify_refuses_a_live_runs_directory(run_dir, where):
    """A live run's launcher holds the run lock of its log.dir and checkpoint directory (here a
    process of its own holds it, as `train`'s launcher does)."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pretrain.runtime.preflight import run_lock
        with run_lock({str(run_dir)!r}, {str(run_dir / 'checkpoints')!r}):
            print("locked", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run_dir)
        out = run_dir if where == "log.dir" else run_dir / "checkpoints"
        res = runner.invoke(app, CERTIFY + ["--out", str(out)])
        assert_one_error_line(res, where, f"in use by another run (PID {holder.pid}")
        assert snapshot(run_dir) == before
    finally:
        holder.stdin.close()
        holder.wait()


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
