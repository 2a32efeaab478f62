"""What watching a step costs: the trainer's step with the step timing and flight recorder on
(``[log] timing = true``, ``flight_records = 64``: a ``CommWatch`` over every collective, a
``StepTimer``, its all-gather) against the same step with both off, tp2 x pp2 on 4 CPU gloo ranks.

    uv run python tools/bench/bench_timing_overhead.py [--repeats 15] [--warmup 3] [--tp 2] [--pp 2]
    uv run python tools/bench/bench_timing_overhead.py --per-call   # the watch's cost per collective

Timing (``paired_timing``): on and off alternate step by step in the same processes, each after a
barrier, the slowest rank's time; ``ratio`` is the median of the per-repeat ratios on / off,
``ratio_min`` / ``ratio_max`` their spread. Ends with ``RESULT timing ratio= ratio_min= ratio_max=
repeats= on_ms= off_ms=``. ``--per-call``: one process, a one-rank group, 2000 all-reduces of 16
floats with and without the watch, 21 alternating pairs: the median added time per call and the
spread (``RESULT per_call added_us= min_us= max_us=``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from commit import print_commit  # noqa: E402


def rank(args) -> dict | None:
    from paired_timing import Summary, paired_times

    from par_groups.watch import CommWatch
    from pretrain.config import load_config
    from pretrain.launch import init_distributed, shutdown
    from pretrain.step_timing import NoTimer, StepTimer
    from pretrain.train_loop import Trainer

    cfg = load_config(None, [f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", "train.warmup_steps=1",
                             f"train.steps={2 * (args.repeats + args.warmup) + 2}"])
    me, _, _, dev = init_distributed(600, "cpu")
    try:
        trainer = Trainer(cfg, device=dev)
        watch = CommWatch(64)
        watch.name_groups(trainer.groups.ranks)
        timer, off = StepTimer(watch, dev), NoTimer()
        counter = iter(range(10**6))

        def watched():
            trainer.timer = timer
            with watch:
                trainer.train_step(next(counter))

        def plain():
            trainer.timer = off
            trainer.train_step(next(counter))

        s = Summary.of(paired_times(watched, plain, args.repeats, args.warmup))
        return s if me == 0 else None
    finally:
        shutdown()


def per_call(pairs: int = 21, calls: int = 2000) -> None:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from par_groups import comm
    from par_groups.watch import CommWatch

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    x, watch = torch.ones(16), CommWatch(64)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            comm.all_reduce(x, None)
        return (time.perf_counter() - start) / calls

    added = []
    for _ in range(pairs):
        off = loop()
        with watch:
            added.append(loop() - off)
    dist.destroy_process_group()
    print(f"RESULT per_call added_us={1e6 * statistics.median(added):.1f} min_us={1e6 * min(added):.1f} "
          f"max_us={1e6 * max(added):.1f} pairs={pairs} calls={calls}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--per-call", action="store_true", help="Only the watch's cost per collective, in this process.")
    args = p.parse_args()
    print_commit()
    if args.per_call:
        return per_call()
    from pretrain.launch import launch

    s = launch(rank, (args,), nproc=args.tp * args.pp, device="cpu")[0]
    print(f"RESULT timing ratio={s.ratio:.4f} ratio_min={s.ratio_min:.4f} ratio_max={s.ratio_max:.4f} "
          f"repeats={s.repeats} on_ms={1e3 * s.ours_s:.1f} off_ms={1e3 * s.peer_s:.1f}")


if __name__ == "__main__":
    main()
