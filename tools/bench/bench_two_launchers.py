"""Two launchers on one host against one launcher with the same ranks: the step time of `pretrain train`
under two torchrun agents (two "nodes" of `--nproc-per-node N/2` on 127.0.0.1, one c10d rendezvous)
against one torchrun agent of `--nproc-per-node N`, the same model and layout.

Each run is a whole `pretrain train` (its own processes, so the two sides cannot share one process);
runs alternate (one launcher, two launchers, two, one, ...) so a slower period of the machine slows
both sides of a pair. A run's step time is the median of its logged `step_time_s` after `--warmup`
steps; the figure is the median of the per-pair ratios two / one with their 95 % CI.

    uv run python tools/bench/bench_two_launchers.py --ranks 4 --steps 30 --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired_timing import Summary  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(log_dir: Path, steps: int, extra: list[str]) -> list[str]:
    sets = [f"train.steps={steps}", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
            f"log.dir={log_dir}", f"checkpoint.dir={log_dir / 'ck'}", "checkpoint.every=0", *extra]
    return ["-m", "pretrain", "train", "--force", *[a for s in sets for a in ("--set", s)]]


def _step_times(log_dir: Path, warmup: int) -> float:
    steps = [json.loads(line) for line in (log_dir / "log.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in steps if "step_time_s" in r and r["step"] > warmup]
    return statistics.median(times)


def one_launcher(root: Path, ranks: int, steps: int, warmup: int, extra: list[str]) -> float:
    log = root / "one"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    *_train_args(log, steps, extra)], check=True, capture_output=True)
    return _step_times(log, warmup)


def two_launchers(root: Path, ranks: int, steps: int, warmup: int, extra: list[str]) -> float:
    log, port = root / "two", _port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                                "--nproc-per-node", str(ranks // 2), "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}",
                                *_train_args(log, steps, extra)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
              for node in (0, 1)]
    for agent in agents:
        _, err = agent.communicate()
        if agent.returncode:
            raise SystemExit(f"a launcher failed (exit {agent.returncode}): {err.decode()[-2000:]}")
    return _step_times(log, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps of each run left out")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--set", action="append", default=["model.layers=2"], help="more config overrides")
    args = parser.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = (one_launcher, two_launchers) if i % 2 == 0 else (two_launchers, one_launcher)
            timed = {f.__name__: f(Path(tmp), args.ranks, args.steps, args.warmup, args.set) for f in order}
            pairs.append((timed["two_launchers"], timed["one_launcher"]))
            print(f"pair {i}: two launchers {timed['two_launchers'] * 1e3:.1f} ms, "
                  f"one launcher {timed['one_launcher'] * 1e3:.1f} ms", flush=True)
    s = Summary.of(pairs)
    print(f"RESULT two-launchers ranks={args.ranks} two_ms={s.ours_s * 1e3:.1f} one_ms={s.peer_s * 1e3:.1f} "
          f"{s.spread()} cpu={os.cpu_count()}")


if __name__ == "__main__":
    main()
