"""Failure handling: a rank that raises ends the whole run in seconds with its error; a non-finite
loss stops with the step named ([train].nan_policy=stop) or drops that step's update (skip)."""

import functools

import torch
from typer.testing import CliRunner

from one_error_line import invoke_within_limit
from pretrain.cli import app

runner = CliRunner()


def test_a_rank_that_raises_ends_the_run_with_its_error(monkeypatch, tmp_path, fault_ranks):
    monkeypatch.setattr("pretrain.training.run.run_rank", functools.partial(fault_ranks.fail_before_step, 1, 3))
    # rank 0 waits in a collective whose timeout is a week: only the launcher ending it on rank 1's error
    # ends the run (the suite's per-test bound only keeps a broken launcher from hanging it; no clock is asserted)
    res = invoke_within_limit(runner, app, ["train", "--nproc", "2", "--set", "train.steps=50", "--set", "model.layers=2",
                                            "--set", "train.eval_every=0", "--set", "log.progress=false",
                                            "--set", f"log.dir={tmp_path}", "--set", "train.collective_timeout_s=604800"])
    assert res.exit_code == 1, res.output
    assert "rank 1 failed" in res.stderr and "injected failure" in res.stderr, res.stderr
    # an internal error: one short line; the traceback is in a file under log.dir
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"traceback in {tmp_path / 'error.log'}" in res.stderr
    assert "injected failure" in (tmp_path / "error.log").read_text()


def test_a_users_error_inside_the_ranks_is_one_line_and_exit_2(tmp_path):
    """A NaN stop is raised inside every rank: at --nproc 2 it reads as at --nproc 1 (exit 2, one line)."""
    res = runner.invoke(app, ["train", "--nproc", "2", "--set", "train.steps=3", "--set", "model.layers=2",
                              "--set", "train.warmup_steps=0", "--set", "train.lr=1e30", "--set", "train.min_lr=0",
                              "--set", "train.eval_every=0", "--set", "log.progress=false", "--set", f"log.dir={tmp_path}",
                              "--set", "train.collective_timeout_s=600"])
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: loss is") and "nan_policy" in res.stderr, \
        res.stderr


def nan_job(policy):
    from pretrain.config import load_config
    from pretrain.errors import UsageError
    from pretrain.training.train_loop import Trainer

    cfg = load_config(None, ["train.steps=4", "train.warmup_steps=1", "train.eval_every=0", "model.layers=2",
                             f"train.nan_policy={policy}"])
    t = Trainer(cfg)
    t.train_step(0)
    before = {k: v.clone() for k, v in t.model.dp.full_state("master").items()}
    with torch.no_grad():
        t.model.chunks[0].layers["0"].input_layernorm.weight.fill_(float("inf"))
    r = t.train_step(1)
    if policy == "stop":  # noted on the device; read at the next log or checkpoint step (Trainer.check_finite)
        t.train_step(2)
        try:
            t.check_finite()
        except UsageError as e:  # a NaN stop is the user's to fix (lr, data): exit 2 and one line
            return {"error": str(e)}
        return {"error": None}
    after = t.model.dp.full_state("master")
    changed = [k for k in before if not before[k].equal(after[k]) and "input_layernorm" not in k]
    return {"skipped": r.skipped, "changed": changed, "optimizer_steps": t.model.dp.step_count}


def test_non_finite_loss_stops_or_skips(dist_run):
    stop, skip = dist_run(1, nan_job, "stop")[0], dist_run(1, nan_job, "skip")[0]
    assert "at step 2" in stop["error"] and "nan_policy" in stop["error"]
    assert skip == {"skipped": True, "changed": [], "optimizer_steps": 1}


def test_a_non_finite_step_stops_at_the_next_log_step_and_no_checkpoint_follows_it(monkeypatch, tmp_path, fault_ranks):
    """Step 3 is not finite; the run reads that at step 4 (its log step: log.every=4) and stops with one
    line naming step 3, exit 2. Checkpoints are written every 2 steps: step 2's is the last."""
    monkeypatch.setattr("pretrain.training.run.run_rank", functools.partial(fault_ranks.inf_weight_before_step, 3))
    ck = tmp_path / "ck"
    res = runner.invoke(app, ["train", "--nproc", "2", "--set", "train.steps=8", "--set", "train.warmup_steps=1", "--set", "model.layers=2",
                              "--set", "train.eval_every=0", "--set", "log.progress=false", "--set", "log.every=4",
                              "--set", f"log.dir={tmp_path}", "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every=2",
                              "--set", "checkpoint.keep=10"])
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: loss is") and "at step 3;" in res.stderr, res.stderr
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_2"]
