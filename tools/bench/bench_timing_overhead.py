"""What watching a step costs: the trainer's step with the step timing and flight recorder on
(``[log] timing = true``, ``flight_records = 64``: a ``CommWatch`` over every collective, a
``StepTimer``, its all-gather) against the same step with both off, tp2 x pp2 on 4 CPU gloo ranks.

    uv run python tools/bench/bench_timing_overhead.py [--repeats 15] [--warmup 3] [--tp 2] [--pp 2]

Timing (``paired_timing``): on and off alternate step by step in the same processes, each after a
barrier, the slowest rank's time; ``ratio`` is the median of the per-repeat ratios on / off,
``ratio_min`` / ``ratio_max`` their spread. Ends with ``RESULT timing ratio= ratio_min= ratio_max=
repeats= on_ms= off_ms=``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    from pretrain.launch import launch

    s = launch(rank, (args,), nproc=args.tp * args.pp, device="cpu")[0]
    print(f"RESULT timing ratio={s.ratio:.4f} ratio_min={s.ratio_min:.4f} ratio_max={s.ratio_max:.4f} "
          f"repeats={s.repeats} on_ms={1e3 * s.ours_s:.1f} off_ms={1e3 * s.peer_s:.1f}")


if __name__ == "__main__":
    main()
