"""[checkpoint].async_save through `pretrain train`: background-written checkpoints hold bitwise what the
synchronous ones hold, resume bitwise, `latest` names the last finished one, keep-N still prunes (in a
thread after the save), the training thread's blocked time is `time_checkpoint` on the next log line, the
staging buffers are reused, and a run that dies with a save in flight leaves the previous checkpoint as
`latest`."""

import functools
import json

import torch
from typer.testing import CliRunner

from pretrain.checkpoint.full_model import read_full_tensors
from pretrain.cli import app

runner = CliRunner()
BASE = ["--set", "train.steps=6", "--set", "train.warmup_steps=2", "--set", "train.eval_every=0",
        "--set", "model.layers=2", "--set", "log.progress=false"]
ASYNC = ["--set", "checkpoint.async_save=true", "--set", "checkpoint.every=1", "--set", "checkpoint.keep=2"]


def _train(*extra):
    return runner.invoke(app, ["train", "--nproc", "2", *BASE, *extra])


def _losses(log_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (log_dir / "log.jsonl").read_text().splitlines()) if "loss" in r}


def _blocked(log_dir):
    """The steps whose log line carries a positive ``time_checkpoint``."""
    return [r["step"] for r in map(json.loads, (log_dir / "log.jsonl").read_text().splitlines())
            if r.get("time_checkpoint", 0) > 0]


def test_staging_buffers_are_allocated_once_and_reused():
    from par_zero import Pieces

    from pretrain.checkpoint.background import Staging

    src = {"model/w": Pieces((4, 3), [((0, 0), torch.ones(2, 3)), ((2, 0), torch.full((2, 3), 2.0))])}
    staging = Staging()
    first, event = staging.stage(src)
    assert event is None and staging.nbytes() == 4 * 3 * 4
    src["model/w"].boxes[0][1].add_(5)
    again, _ = staging.stage(src)
    assert [t.data_ptr() for _, t in first["model/w"].boxes] == [t.data_ptr() for _, t in again["model/w"].boxes]
    assert again["model/w"].boxes[0][1].equal(torch.full((2, 3), 6.0))  # a copy, taken at stage time
    assert all(t.data_ptr() != s.data_ptr() for (_, t), (_, s) in zip(again["model/w"].boxes, src["model/w"].boxes))


def test_pruning_runs_after_publish_in_a_thread_and_is_waited_for(tmp_path):
    from pretrain.checkpoint import retention

    root = tmp_path / "ck"
    for name in ("step_1", "step_2", "step_3"):
        (root / name).mkdir(parents=True)
        (root / name / "trainer_state.json").write_text(json.dumps({"run_id": "r1"}))
    (root / "manifest.json").write_text(json.dumps({"run_id": "r1", "saves": ["step_1", "step_2"]}))
    pruned = retention.publish(root, root / "step_3", keep=1)
    assert pruned == ["step_1", "step_2"] and (root / "step_1").is_dir()  # publish deletes nothing
    assert (root / "latest").read_text().strip() == "step_3"
    retention.prune_in_background(root, pruned)
    retention.wait_pruned()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "manifest.json", "step_3"]
    assert json.loads((root / "manifest.json").read_text())["saves"] == ["step_3"]


def _steps(ck):
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("step_"))


def test_async_saves_resume_bitwise_like_sync_ones_and_keep_latest_and_pruning(tmp_path):
    sync_ck, ck = tmp_path / "sync", tmp_path / "async"
    res = _train("--set", f"log.dir={tmp_path / 'full'}", "--set", "checkpoint.every=3", "--set", f"checkpoint.dir={sync_ck}")
    assert res.exit_code == 0, res.output
    res = _train(*ASYNC, "--set", "train.stop_at=4", "--set", f"checkpoint.dir={ck}", "--set", f"log.dir={tmp_path / 'a'}")
    assert res.exit_code == 0, res.output
    assert (ck / "latest").read_text().strip() == "step_4" and _steps(ck) == ["step_3", "step_4"]
    res = _train(*ASYNC, "--set", "checkpoint.resume=true", "--set", f"checkpoint.dir={ck}",
                 "--set", f"log.dir={tmp_path / 'b'}")
    assert res.exit_code == 0, res.output
    full, a, b = _losses(tmp_path / "full"), _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [5, 6]
    # the training thread's blocked time of the saves since the previous log line: on the next one
    assert _blocked(tmp_path / "a") == [2, 3, 4] and _blocked(tmp_path / "full") == [4]
    assert a | b == full  # bitwise equal floats
    assert (ck / "latest").read_text().strip() == "step_6" and _steps(ck) == ["step_5", "step_6"]
    # the final checkpoints of both runs hold the same bits: model, moments and RNG states
    for prefix in ("model/", "optim/exp_avg/", "optim/exp_avg_sq/"):
        want, got = read_full_tensors(sync_ck / "step_6", prefix), read_full_tensors(ck / "step_6", prefix)
        assert sorted(want) == sorted(got) and want and all(want[k].equal(got[k]) for k in want), prefix
    for r in (0, 1):
        want, got = (torch.load(c / "step_6" / "rng" / f"rank_{r}.pt", weights_only=True) for c in (sync_ck, ck))
        assert want["cpu"].equal(got["cpu"])
    state = json.loads((ck / "step_6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["optimizer_steps"] == 6


def test_a_run_dying_with_a_save_in_flight_keeps_the_previous_latest(monkeypatch, tmp_path, fault_ranks):
    ck = tmp_path / "ck"
    # rank 0 raises before step 3: step_2 was started in the background, never published
    monkeypatch.setattr("pretrain.training.run.run_rank", functools.partial(fault_ranks.fail_before_step, 0, 3))
    res = _train(*ASYNC, "--set", f"checkpoint.dir={ck}", "--set", f"log.dir={tmp_path / 'log'}")
    assert res.exit_code == 1 and "rank 0 failed" in res.stderr and "injected failure" in res.stderr, res.output
    assert (ck / "latest").read_text().strip() == "step_1"
    assert (ck / "step_1" / "trainer_state.json").is_file() and not (ck / "step_2").exists()
