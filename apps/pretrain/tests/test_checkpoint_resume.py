"""Through `pretrain train`: stop_at + resume gives bitwise the uninterrupted run's losses; a checkpoint
for another model, or a corrupt one, is one clear error; SIGTERM writes a checkpoint, then exits."""

import json
import signal
import subprocess
import sys
import time

from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()
BASE = ["--set", "train.steps=6", "--set", "train.warmup_steps=2", "--set", "train.eval_every=0",
        "--set", "model.layers=2", "--set", "log.progress=false"]


def _train(*extra, nproc=2):
    res = runner.invoke(app, ["train", "--nproc", str(nproc), *BASE, *extra])
    return res


def _losses(log_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (log_dir / "log.jsonl").read_text().splitlines()) if "loss" in r}


def test_stop_at_then_resume_is_bitwise_the_uninterrupted_run_and_bad_checkpoints_are_clear(tmp_path):
    ck = tmp_path / "ck"
    res = _train("--set", f"log.dir={tmp_path / 'full'}")
    assert res.exit_code == 0, res.output
    res = _train("--set", f"log.dir={tmp_path / 'a'}", "--set", "train.stop_at=3", "--set", f"checkpoint.dir={ck}")
    assert res.exit_code == 0, res.output
    assert (ck / "latest").read_text().strip() == "step_3"
    res = _train("--set", f"log.dir={tmp_path / 'b'}", "--set", "checkpoint.resume=true", "--set", f"checkpoint.dir={ck}")
    assert res.exit_code == 0, res.output
    full, a, b = _losses(tmp_path / "full"), _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(a) == [1, 2, 3] and sorted(b) == [4, 5, 6]
    assert a | b == full  # bitwise equal floats
    # another model's checkpoint: the error names what differs
    res = _train("--set", "model.hidden=32", "--set", "checkpoint.resume=true", "--set", f"checkpoint.dir={ck}",
                 "--set", f"log.dir={tmp_path / 'c'}", nproc=1)
    assert res.exit_code == 2 and "[model].hidden: checkpoint 64, config 32" in res.stderr, res.output
    assert "Traceback" not in res.output
    (ck / (ck / "latest").read_text().strip() / ".metadata").unlink()  # corrupt the checkpoint resume would take
    res = _train("--set", "checkpoint.resume=true", "--set", f"checkpoint.dir={ck}", "--set", f"log.dir={tmp_path / 'd'}",
                 nproc=1)
    assert res.exit_code == 2 and "is damaged: .metadata is missing" in res.stderr, res.output


def test_sigterm_writes_a_checkpoint_then_exits(tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "log"
    cmd = [sys.executable, "-m", "pretrain", "train", "--nproc", "1", "--set", "train.steps=300",
           "--set", "train.eval_every=0", "--set", "model.layers=2", "--set", "log.progress=false",
           "--set", f"checkpoint.dir={ck}", "--set", f"log.dir={log}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((log / "log.jsonl").exists() and (log / "log.jsonl").read_text().count("\n") >= 2):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    step = int((ck / "latest").read_text().strip().split("_")[1])
    assert 2 <= step < 300 and (ck / f"step_{step}" / "trainer_state.json").is_file(), out
