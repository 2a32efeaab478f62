"""Tokens/s of the training step with ``[train].compile`` on against off, CPU, fp32, on one rank or several.

    uv run python tools/bench/bench_compile.py [--config tiny.toml] [--repeats 21] [--warmup 3] [--steps 4] [--threads 1] [--set k=v ...]
    uv run python tools/bench/bench_compile.py --nproc 2 --set parallel.tp=2    # tp2 + SP, with the run's defaults

With ``--nproc N`` the ranks run under the watch a run has by default (flight records and timing:
``CommWatch``), so compiled blocks see the same collectives and records as ``pretrain train``'s; each
repeat's time is the slowest rank's.

Two trainers on the same model (the embedded tiny.toml unless --config), one with each transformer
block compiled by inductor, one eager; per repeat ``--steps`` optimizer steps of each, in alternating
order (tools/bench/paired_timing.py). The warm-up repeats (the compilation is in the first) are dropped.
Prints the commit measured and ``RESULT compile ratio= ratio_min= ratio_max= repeats=``: the
median of the per-repeat ratios compiled / eager tokens/s (above 1: compiled is faster), their
min and max, and both sides' median tokens/s. One intra-op thread by default, as bench_split_backward:
on a small shared machine a preempted second thread stalls every parallel kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from commit import print_commit
from paired_timing import median_ci, paired_times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="a TOML config (default: the embedded tiny.toml)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per timed repeat")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a config override, as pretrain's --set")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (gloo), each under the run's default watch")
    args = ap.parse_args()
    print_commit()
    if args.nproc == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29581")
        dist.init_process_group("gloo", rank=0, world_size=1)
        out = measure(vars(args))
        dist.destroy_process_group()
    else:
        from par_groups.testing import RankPool

        pool = RankPool(args.nproc)
        try:
            out = pool.run(measure, vars(args), timeout=3600)[0]
        finally:
            pool.close()
    print(out)


def measure(args: dict) -> str:
    """The paired timing on this rank (every rank runs it); rank 0's report."""
    from par_groups.watch import CommWatch

    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    torch.set_num_threads(args["threads"])
    steps = (args["warmup"] + args["repeats"]) * args["steps"]
    base = [f"train.steps={2 * steps}", "train.eval_every=0", "log.progress=false"] + args["overrides"]
    with CommWatch(0):  # what pretrain train has on by default ([log] flight_records, timing)
        trainers = {c: Trainer(load_config(args["config"], base + [f"train.compile={str(c).lower()}"]))
                    for c in (True, False)}
        cfg = trainers[True].cfg
        tokens = cfg.train.global_batch * cfg.train.seq_len * args["steps"]  # per repeat
        step = {c: 0 for c in trainers}

        def run(c):
            def one():
                for _ in range(args["steps"]):
                    trainers[c].train_step(step[c])
                    step[c] += 1
            return one

        pairs = paired_times(run(True), run(False), repeats=args["repeats"], warmup=args["warmup"])
    speedups = [eager / compiled for compiled, eager in pairs]  # tokens/s compiled over tokens/s eager
    m = cfg.model
    compiled_tps = statistics.median(tokens / p[0] for p in pairs)
    eager_tps = statistics.median(tokens / p[1] for p in pairs)
    ci = median_ci(speedups)
    return (f"model: layers={m.layers} hidden={m.hidden} heads={m.heads} seq_len={cfg.train.seq_len} "
            f"global_batch={cfg.train.global_batch} ({tokens // args['steps']} tokens/step), {args['steps']} steps "
            f"per repeat, threads={args['threads']}, ranks={dist.get_world_size()} {' '.join(args['overrides'])}\n"
            f"RESULT compile ratio={statistics.median(speedups):.2f} ratio_min={min(speedups):.2f} "
            f"ratio_max={max(speedups):.2f} ci95={ci[0]:.2f}-{ci[1]:.2f} repeats={len(pairs)} "
            f"compiled_tokens_s={compiled_tps:.0f} eager_tokens_s={eager_tps:.0f}")

if __name__ == "__main__":
    main()
