"""[checkpoint].async_save through `pretrain train`: background-written checkpoints hold bitwise what the
synchronous ones hold, resume bitwise, `latest` names the last finished one, keep-N still prunes (in a
thread after the save), the training thread's blocked time is `time_checkpoint` on the next log line, the
staging buffers are reused, and a run that dies with a save in flight leaves the previous checkpoint as
`latest`. A save is published as soon as every rank has written it, not at the next save: a SIGKILL of
the launcher's process group between two saves or during one resumes from the newest checkpoint
whose write had completed, and the resumed run's losses are bitwise the uninterrupted run's."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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
    # rank 0 raises before step 3: step_2 was started in the background, never published, as rank 1's
    # write of it never completes
    monkeypatch.setattr("pretrain.training.run.run_rank", functools.partial(
        fault_ranks.fail_before_step, 0, 3, held_write=(str(tmp_path), 1, 2)))
    res = _train(*ASYNC, "--set", f"checkpoint.dir={ck}", "--set", f"log.dir={tmp_path / 'log'}")
    assert res.exit_code == 1 and "rank 0 failed" in res.stderr and "injected failure" in res.stderr, res.output
    assert (ck / "latest").read_text().strip() == "step_1"
    assert (ck / "step_1" / "trainer_state.json").is_file() and not (ck / "step_2").exists()


TESTS = Path(__file__).parent
EVERY_2 = ["--set", "checkpoint.async_save=true", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=2"]
# a real `pretrain train` whose ranks run fault_ranks.hold (its arguments formatted in) instead of run_rank
HELD_TRAIN = ("import functools, fault_ranks, pretrain.training.run as run; "
              "run.run_rank = functools.partial(fault_ranks.hold, {}, {}, {}); "
              "from pretrain.cli import main; main()")


def _killed_when(ready, folder: Path, before_step, write, *args) -> str:
    """Run ``pretrain train *args`` in its own process group with ``fault_ranks.hold(folder, before_step, write)``
    as its ranks' entry, SIGKILL the group (launcher, forkserver, ranks) once ``ready()``; its output."""
    folder.mkdir()
    code = HELD_TRAIN.format(repr(str(folder)), repr(before_step), repr(write))
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
                        "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code, "train", "--nproc", "2", *BASE, *EVERY_2, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150  # a bound on a hang, not a timing: the tiny run is there in seconds
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL and ready(), out
    return out


def _said(text: str, out: str) -> bool:
    """``text`` is in ``out``, however the console wrapped its lines."""
    return "".join(text.split()) in "".join(out.split())


def _latest(ck) -> str | None:
    marker = ck / "latest"
    return marker.read_text().strip() if marker.is_file() else None


@pytest.mark.timeout(600)  # three whole `pretrain train` in their own processes, two more in this one
def test_sigkill_between_or_during_async_saves_resumes_from_the_newest_written_one_bitwise(tmp_path):
    """A run of 6 steps saving every 2, killed three times, each resume continuing the killed run:
    (1) after step 2, the save of step_2 just started; (2) after step 5, just before the save of
    step 6; (3) during the save of step_6: rank 1 has written its files but the save is not complete.
    At (1) and (2) the newest save is published while the training thread is held, at (3) it is not."""
    ck, log = tmp_path / "ck", tmp_path / "log"
    res = _train(*EVERY_2, "--set", f"checkpoint.dir={tmp_path / 'ref_ck'}", "--set", f"log.dir={tmp_path / 'ref'}")
    assert res.exit_code == 0, res.output
    reference = _losses(tmp_path / "ref")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    run = ["--set", f"checkpoint.dir={ck}", "--set", f"log.dir={log}"]
    resume = [*run, "--set", "checkpoint.resume=true"]

    def held_with_latest(folder, name):
        return lambda: all((folder / f"held_{r}").exists() for r in (0, 1)) and _latest(ck) == name

    _killed_when(held_with_latest(tmp_path / "k1", "step_2"), tmp_path / "k1", 3, None, *run)
    assert _steps(ck) == ["step_2"]
    out = _killed_when(held_with_latest(tmp_path / "k2", "step_4"), tmp_path / "k2", 6, None, *resume)
    assert _said(f"resumed from {ck / 'step_2'} at step 2", out), out
    assert _steps(ck) == ["step_2", "step_4"]
    out = _killed_when(lambda: (tmp_path / "k3" / "writing_1").exists(), tmp_path / "k3", None, (1, 6), *resume)
    assert _said(f"resumed from {ck / 'step_4'} at step 4", out), out
    assert _latest(ck) == "step_4" and _steps(ck) == ["step_2", "step_4", "step_6.tmp"]

    res = _train(*EVERY_2, *resume)
    assert res.exit_code == 0, res.output
    logged = [json.loads(line).get("step") for line in (log / "log.jsonl").read_text().splitlines()]
    assert _losses(log) == reference and len(logged) == len(set(logged))  # bitwise equal floats, each step once
    assert _latest(ck) == "step_6" and _steps(ck) == ["step_4", "step_6"]
