"""What a dead rank costs: ``[train].fault_tolerance = "replica"`` against a restart from the last checkpoint,
on the CPU (gloo), dp2 of the tiny model; ``--device cuda`` on two GPUs (NCCL: its abort and the regroup).

    uv run python tools/bench/bench_replica_fault.py [--steps 12] [--kill-step 6] [--every 4] [--device cpu]

Both runs SIGKILL rank 1 in the forward of step ``--kill-step`` (the kill helper of the tests,
``apps/pretrain/tests/replica_kills.py``, notes the time of the kill):

- ``replica``: the survivor regroups and redoes the step (``respawn = false``). ``kill_to_step_s``: from the
  kill to the log line of the redone step; ``step_missing_s`` / ``step_full_s``: the median step time
  with one replica left (it trains both replicas' micro-batches) and with both, before the kill.
- ``restart``: fault tolerance off, a checkpoint every ``--every`` steps; the run ends with the kill and
  is started again with ``checkpoint.resume = true`` (what a scheduler's requeue does, minus its
  queueing). ``kill_to_step_s``: from the kill to the log line of the killed step in the resumed run
  (the launcher's failure, a new launch, the load, the steps since the checkpoint redone).

Prints ``RESULT <label> <what>_s=<seconds>`` lines (``--label``, default ``replica-fault``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "apps" / "pretrain" / "tests"))  # the kill helper, importable by the ranks


def _run(app, runner, tmp: Path, steps: int, device: str, *extra: str):
    args = ["train", "--nproc", "2", "--set", f"train.device={device}", "--set", "model.layers=2",
            "--set", f"train.steps={steps}",
            "--set", "train.warmup_steps=1", "--set", "train.eval_every=0", "--set", "log.progress=false",
            "--set", f"log.dir={tmp / 'log'}", "--set", f"checkpoint.dir={tmp / 'ck'}", *extra]
    return runner.invoke(app, args)


def _steps(log: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (log / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r and "event" not in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-step", type=int, default=6)
    parser.add_argument("--every", type=int, default=4, help="checkpoint interval of the restart run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one rank per GPU, NCCL")
    parser.add_argument("--label", default="replica-fault", help="the RESULT lines' name")
    a = parser.parse_args()
    import pytest
    from typer.testing import CliRunner

    import replica_kills
    from pretrain.cli import app

    runner = CliRunner()
    with tempfile.TemporaryDirectory() as root:
        tmp = Path(root) / "replica"
        (tmp / "pids").mkdir(parents=True)
        entry = functools.partial(replica_kills.sigkill_at, 1, a.kill_step, "forward", str(tmp / "pids"))
        with pytest.MonkeyPatch.context() as m:
            m.setattr("pretrain.training.run.run_rank", entry)
            res = _run(app, runner, tmp, a.steps, a.device, "--set", "train.fault_tolerance=replica",
                       "--set", "train.respawn=false")
        assert res.exit_code == 0, res.output
        killed = float((tmp / "pids" / "killed_1_at").read_text())
        steps = _steps(tmp / "log")
        print(f"RESULT {a.label} replica_kill_to_step_s={steps[a.kill_step]['time'] - killed:.3f}")
        full = [steps[s]["step_time_s"] for s in range(2, a.kill_step)]
        missing = [steps[s]["step_time_s"] for s in range(a.kill_step + 1, a.steps + 1)]
        print(f"RESULT {a.label} step_full_s={statistics.median(full):.4f}")
        print(f"RESULT {a.label} step_missing_s={statistics.median(missing):.4f}")

        tmp = Path(root) / "restart"
        (tmp / "pids").mkdir(parents=True)
        entry = functools.partial(replica_kills.sigkill_at, 1, a.kill_step, "forward", str(tmp / "pids"))
        every = ["--set", f"checkpoint.every={a.every}"]
        with pytest.MonkeyPatch.context() as m:
            m.setattr("pretrain.training.run.run_rank", entry)
            res = _run(app, runner, tmp, a.steps, a.device, *every)
        assert res.exit_code == 1, res.output
        killed = float((tmp / "pids" / "killed_1_at").read_text())
        res = _run(app, runner, tmp, a.steps, a.device, *every, "--set", "checkpoint.resume=true")
        assert res.exit_code == 0, res.output
        print(f"RESULT {a.label} restart_kill_to_step_s={_steps(tmp / 'log')[a.kill_step]['time'] - killed:.3f}")


if __name__ == "__main__":
    main()
