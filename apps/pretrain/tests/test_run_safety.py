"""A run keeps what it must and deletes only what it owns (issue 21, defects 1, 2, 10, 12).

- Retention follows the run's own save order: a re-run that saves step_2 after an older step_4
  keeps step_2 and `latest` names it (it used to prune by step number and delete it).
- A user's `step_5_backup/` and `step_best/` in the checkpoint directory are never touched.
- A new run into another run's checkpoints refuses (exit 2) unless --force; a second run on a
  live log.dir refuses naming the PID; log lines carry the run id; a new run starts its own log.
- The default run (checkpoint.every = 0) still writes a final checkpoint.
- The README's GPU-extra command resolves at the workspace root; --help keeps `[train]`.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[3]
GPU_SYNC = "uv sync --all-packages --extra gpu"


def _train(log, ck, *extra):
    return runner.invoke(app, ["train", "--nproc", "1", "--set", "model.layers=2", "--set", "train.warmup_steps=1",
                               "--set", "train.eval_every=0", "--set", "log.progress=false", "--set", f"log.dir={log}",
                               "--set", f"checkpoint.dir={ck}", *extra])


def _log(log):
    return [json.loads(line) for line in (log / "log.jsonl").read_text().splitlines()]


def test_retention_by_save_order_never_deletes_what_the_run_does_not_own(tmp_path):
    from pretrain.training.preflight import run_lock

    log, ck = tmp_path / "log", tmp_path / "ck"
    for mine in ("step_5_backup", "step_best"):
        (ck / mine).mkdir(parents=True)
        (ck / mine / "notes.txt").write_text("the user's\n")
    res = _train(log, ck, "--set", "train.steps=4", "--set", "checkpoint.every=1", "--set", "checkpoint.keep=2")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["step_3", "step_4", "step_5_backup", "step_best"]
    first = _log(log)
    assert [r["step"] for r in first] == [1, 2, 3, 4] and len({r["run_id"] for r in first}) == 1

    res = _train(log, ck, "--set", "train.steps=2")  # a new run into the same directories
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "another run's checkpoints" in res.stderr, res.output

    with run_lock(log):  # a live run holds the log directory
        res = _train(log, ck, "--set", "train.steps=2", "--force")
    assert res.exit_code == 2 and "in use by another run (PID" in res.stderr, res.output

    res = _train(log, ck, "--set", "train.steps=2", "--set", "checkpoint.every=1", "--set", "checkpoint.keep=1",
                 "--force")
    assert res.exit_code == 0, res.output
    assert (ck / "latest").read_text().strip() == "step_2" and (ck / "step_2" / "trainer_state.json").is_file()
    assert not (ck / "step_1").exists()  # this run's own older save, pruned (keep=1)
    assert (ck / "step_4" / "trainer_state.json").is_file()  # the first run's: not this run's to delete
    assert (ck / "step_5_backup" / "notes.txt").is_file() and (ck / "step_best" / "notes.txt").is_file()
    second = _log(log)
    assert [r["step"] for r in second] == [1, 2] and {r["run_id"] for r in second}.isdisjoint({first[0]["run_id"]})

    shutil.rmtree(ck)
    res = _train(log, ck, "--set", "train.steps=1")  # checkpoint.every = 0: still a final checkpoint
    assert res.exit_code == 0 and (ck / "latest").read_text().strip() == "step_1", res.output


def test_help_keeps_section_names():
    res = runner.invoke(app, ["train", "--help"])
    assert res.exit_code == 0 and "[train].nproc" in res.stdout, res.stdout


def test_readme_gpu_extra_resolves_at_the_workspace_root():
    if shutil.which("uv") is None:
        pytest.skip("uv is not on PATH")
    assert GPU_SYNC in (ROOT / "README.md").read_text()
    # --offline --frozen --dry-run: resolves from uv.lock only, downloads and installs nothing
    res = subprocess.run(GPU_SYNC.split() + ["--frozen", "--offline", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "flash-attn" in res.stdout + res.stderr, res.stdout + res.stderr


# ---- issue 40: two runs sharing a directory, names that leave it, the filesystem root -----------------------


def test_a_live_run_holds_its_checkpoint_dir_and_a_new_run_keeps_the_earlier_log(tmp_path):
    from pretrain.training.preflight import run_lock

    ck = tmp_path / "ck"
    with run_lock(tmp_path / "first_log", ck):  # a live run that has not saved yet
        res = _train(tmp_path / "second_log", ck, "--set", "train.steps=1")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "in use by another run (PID" in res.stderr, res.output
    assert not (ck / "manifest.json").exists()

    log = tmp_path / "log"
    assert _train(log, tmp_path / "ck1", "--set", "train.steps=2").exit_code == 0
    first = _log(log)
    res = _train(log, tmp_path / "ck2", "--set", "train.steps=1")  # a new run, same log.dir, other checkpoints
    assert res.exit_code == 0, res.output
    kept = log / f"log.{first[0]['run_id']}.jsonl"
    assert "kept as" in res.stdout and [json.loads(x) for x in kept.read_text().splitlines()] == first
    assert [r["step"] for r in _log(log)] == [1] and _log(log)[0]["run_id"] != first[0]["run_id"]


def test_the_filesystem_root_is_refused_before_anything_is_written_there(monkeypatch):
    import pretrain.training.preflight as preflight
    from pretrain.config import load_config
    from pretrain.errors import UsageError

    def never(path, what):
        raise AssertionError(f"{what} {path} would be written")  # so a missing check writes nothing into /

    monkeypatch.setattr(preflight, "check_writable", never)
    for sets in (["log.dir=/"], ["log.dir=runs/a", "checkpoint.dir=/"]):
        cfg = load_config(None, sets)
        with pytest.raises(UsageError, match="is the filesystem root"):
            preflight.check_run(cfg, cfg.validate_world(1))


def test_retention_deletes_only_step_dirs_inside_the_checkpoint_dir(tmp_path):
    from pretrain.checkpoint.retention import publish, read_manifest
    from pretrain.checkpoint.store import latest_checkpoint
    from pretrain.errors import UsageError

    root, victim = tmp_path / "ck", tmp_path / "victim" / "step_7"
    for path in (root / "step_8", victim):
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"run_id": "r1"}))
    (root / "manifest.json").write_text(json.dumps({"run_id": "r1", "saves": ["../victim/step_7"]}))
    with pytest.raises(UsageError, match=r"lists '../victim/step_7', not a step_<N> checkpoint"):
        read_manifest(root)
    with pytest.raises(UsageError):
        publish(root, root / "step_8", keep=1)
    assert (victim / "trainer_state.json").is_file()
    for name in ("../victim/step_7", str(victim), ".."):
        (root / "latest").write_text(name + "\n")
        with pytest.raises(UsageError, match="which is not a checkpoint inside"):
            latest_checkpoint(root)
