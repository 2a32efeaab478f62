"""Watching a run: the time breakdown on every log line (a slowed rank shows as the straggler), a
profiler trace with our named ranges, W&B offline, the report PNG, the schedule PNG."""

import functools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.observe.metrics import MetricsLogger

runner = CliRunner()
SLOW_S = 0.4
STEPS = 3


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    """pp=2 on 2 ranks, rank 1 sleeping SLOW_S in each data step, step 3 profiled, W&B offline."""
    import sys

    tests = str(Path(__file__).parent)
    sys.path.insert(0, tests)  # the ranks import fault_ranks by name (inherited by the forkserver)
    import fault_ranks

    log_dir = tmp_path_factory.mktemp("watched")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setattr("pretrain.training.run.run_rank", functools.partial(fault_ranks.slow_data, 1, SLOW_S))
    res = runner.invoke(app, ["train", "--nproc", "2", "--set", "parallel.pp=2", "--set", "model.layers=2",
                              "--set", f"train.steps={STEPS}", "--set", "train.warmup_steps=1",
                              "--set", "train.eval_every=0", "--set", "log.progress=false",
                              "--set", f"log.dir={log_dir}", "--set", "train.collective_timeout_s=600",
                              "--set", "profile.steps=\"3\"", "--set", "log.wandb=true",
                              "--set", "log.wandb_tags=[\"ci\"]"])
    mp.undo()
    sys.path.remove(tests)
    assert res.exit_code == 0, res.output
    return log_dir, res.stdout


def test_every_line_has_the_breakdown_and_the_slowed_rank_is_the_straggler(watched_run):
    log_dir, _ = watched_run
    lines = [json.loads(line) for line in (log_dir / "log.jsonl").read_text().splitlines()]
    assert len(lines) == STEPS
    for r in lines:
        parts = r["time_data_s"] + r["time_fwd_bwd_s"] + r["time_optimizer_s"]
        # the phases lie inside the logged step (how much of it they cover is a timing: tools/bench)
        assert 0 < parts <= r["step_time_s"] * 1.01 + 1e-3, r
        assert r["straggler_rank"] == 1 and r["time_busy_max_s"] > SLOW_S, r
        assert 0 <= r["pp_bubble"] < 1, r
    # Rank 0 waits for rank 1's sleep in the pipeline's receives, less what it does between steps
    # while rank 1 sleeps (step 1: opening the log and W&B; later: logging, starting the profiler).
    later = lines[1:]
    assert sum(r["time_exposed_comm_s"] for r in later) / len(later) > 0.3 * SLOW_S, later
    # The mean over ranks: rank 0 idles through most of rank 1's sleep (0.9 measured), rank 1 hardly
    # (0.05-0.2 measured), so the median of the two (the lower) sat on the edge of any threshold.
    assert all(r["pp_bubble"] > 0.2 for r in later), later
    line = MetricsLogger.format(lines[1])  # the console's line (the ranks' stdout is not captured here)
    assert " | fwd-bwd " in line and "(comm " in line and "bubble " in line and " | slowest r1 " in line, line


def test_the_profile_is_a_chrome_trace_with_our_ranges(watched_run):
    log_dir, _ = watched_run
    for rank in (0, 1):
        trace = json.loads((log_dir / "profile" / f"step_{STEPS}" / f"rank_{rank}.json").read_text())
        events = trace["traceEvents"]
        assert all(isinstance(e.get("ph"), str) and "name" in e for e in events)
        spans = {e["name"] for e in events if e["ph"] == "X" and isinstance(e.get("ts"), (int, float))
                 and isinstance(e.get("dur"), (int, float))}
        assert {"F0.c%d" % rank, "B0.c%d" % rank} <= spans, sorted(spans)[:20]
        other = 1 - rank
        arrow = f"->{other}" if rank == 0 else f"<-{other}"
        assert f"comm.send[pp]->{other}" in spans and f"comm.recv[pp]<-{other}" in spans, arrow
        assert "comm.all_reduce[pp]" in spans
    assert "CPU Mem" in (log_dir / "profile" / f"step_{STEPS}" / "rank_0_memory.txt").read_text()
    assert not (log_dir / "profile" / "step_2").exists()


def test_wandb_offline_run_holds_the_metrics(watched_run):
    log_dir, _ = watched_run
    runs = list((log_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_id = json.loads((log_dir / "log.jsonl").read_text().splitlines()[0])["run_id"]
    assert runs[0].name.endswith(run_id)  # our run id is W&B's: a resumed run continues it
    data = (runs[0] / f"run-{run_id}.wandb").read_bytes()
    for key in (b"train/loss", b"train/time_fwd_bwd_s", b"train/straggler_rank", b"layout", b"ci"):  # metrics, config, tags
        assert key in data, key


def test_report_draws_one_png_and_page(watched_run):
    log_dir, _ = watched_run
    res = runner.invoke(app, ["report", str(log_dir)])
    assert res.exit_code == 0, res.output
    png = (log_dir / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "slowest rank most often: 1" in res.stdout
    assert "data:image/png;base64," in (log_dir / "report.html").read_text()


def test_report_of_a_directory_without_a_log_is_one_line(tmp_path):
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and res.stderr.startswith("error:") and "log.jsonl" in res.stderr
    assert res.stderr.count("\n") == 1


def test_schedule_png(tmp_path):
    out = tmp_path / "s.png"
    res = runner.invoke(app, ["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1", "--png", str(out)])
    assert res.exit_code == 0 and "bubble fraction" in res.stdout, res.output
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("steps", ["0", "3-2", "a-b", "2-", "-3"])
def test_a_bad_profile_window_is_one_line(steps):
    from pretrain.config import load_config
    from pretrain.errors import UsageError

    with pytest.raises(UsageError, match=r"\[profile\]\.steps=.* must be a step or a range"):
        load_config(None, [f'profile.steps="{steps}"'])
    assert load_config(None, ['profile.steps="20-22"']).profile.window() == (20, 22)
    assert load_config(None, ['profile.steps="5"']).profile.window() == (5, 5)


def test_wandb_without_the_package_is_one_line_before_any_rank_starts(monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    res = runner.invoke(app, ["train", "--nproc", "2", "--set", "log.wandb=true", "--set", f"log.dir={tmp_path}"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    assert res.stderr.startswith("error: [log].wandb = true needs the wandb package"), res.stderr
    res = runner.invoke(app, ["train", "--set", "log.wandb_tags=[1]", "--set", f"log.dir={tmp_path}"])
    assert res.exit_code == 2 and "[log].wandb_tags must be a list of strings" in res.stderr, res.output


def test_a_profiled_step_prints_no_kineto_notes(tmp_path, capfd):  # issue 50: 12 USDT lines per profiled run
    import os

    import torch

    from pretrain.config import load_config
    from pretrain.observe.profile_window import ProfileWindow, _without_kineto_notes

    cfg = load_config(None, ['profile.steps="1-2"', f"log.dir={tmp_path}"])
    window = ProfileWindow(cfg, 0, torch.device("cpu"))
    for step in (1, 2):
        window.before(step)
        torch.ones(4).sum()
        window.after(step)
    _without_kineto_notes(lambda: os.write(2, b"a real error\n"))  # anything else still shows
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_st" not in err and err.count("a real error") == 1, err
    assert (tmp_path / "profile" / "step_2" / "rank_0.json").is_file()


def test_a_long_runs_breakdown_has_no_per_step_markers_over_its_bars():  # issue 50: red triangles hid the bars
    from pretrain.observe.plots import _breakdown, pyplot

    keys = ("time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_exposed_comm_s", "time_busy_max_s")
    for steps, marked in ((200, False), (10, True)):
        train = [{k: 0.1 for k in keys} | {"step": i, "step_time_s": 0.4} for i in range(1, steps + 1)]
        fig, ax = pyplot().subplots()
        _breakdown(ax, train, [r["step"] for r in train])
        assert any(line.get_marker() not in (None, "None", "") for line in ax.get_lines()) == marked, steps
        pyplot().close(fig)


def test_profile_every_traces_each_nth_step_beside_the_window(tmp_path):
    """[profile].every = N (torchtitan's profile_freq): steps N, 2N, ... traced, with the steps window too."""
    import torch

    from pretrain.config import load_config
    from pretrain.observe.profile_window import ProfileWindow

    cfg = load_config(None, ["profile.every=3", 'profile.steps="5"', "profile.memory=false", f"log.dir={tmp_path}"])
    window = ProfileWindow(cfg, 0, torch.device("cpu"))
    for step in range(1, 8):
        window.before(step)
        torch.ones(4).sum()
        window.after(step)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step_3", "step_5", "step_6"]
    assert [s for s in range(1, 10) if load_config(None, ["profile.every=4"]).profile.traces(s)] == [4, 8]
