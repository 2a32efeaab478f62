"""What watching a step costs: the trainer's step with the step timing and flight recorder on
(``[log] timing = true``, ``flight_records = 64``: a ``CommWatch`` over every collective, a
``StepTimer``, its all-gather) against the same step with both off, tp2 x pp2 on 4 CPU gloo ranks.

    uv run python tools/bench/bench_timing_overhead.py [--rounds 30] [--warmup 4] [--tp 2] [--pp 2]
    uv run python tools/bench/bench_timing_overhead.py --ablate     # also the watch alone, the timer alone
    uv run python tools/bench/bench_timing_overhead.py --cprofile 0 # rank 0's profile of each mode
    uv run python tools/bench/bench_timing_overhead.py --per-call   # the watch's cost per collective

The same trainer in the same processes runs every mode once per round, the order rotated from
round to round (no mode always first after a mode that warms or cools a cache); each step starts
after a barrier. Per step: its wall time (the slowest rank's) and its CPU time (the main threads'
CPU time summed over the ranks: the compute and Python work, without the waiting, so it hardly
moves with the machine's load; gloo's own threads are not in it). The first ``warmup`` rounds are
discarded. Per mode the figures are the medians [min, max] of the per-round ratios mode / off:
a load that slows one round slows every mode of it alike. The load average before and after is
printed with them. Ends with ``RESULT <mode> wall= [min,max] cpu= [min,max] rounds= on_ms= off_ms=``.
``--per-call``: one process, a one-rank group, 2000 all-reduces of 16 floats with and without the
watch, 21 alternating pairs: the median added time per call (``RESULT per_call added_us=``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

MODES = ("off", "on")
ABLATIONS = ("watch", "timer")  # the watch alone (no timer, no all-gather); the timer alone (unwatched)


def rank(args) -> dict | None:
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist

    from par_groups.watch import CommWatch
    from pretrain.config import load_config
    from pretrain.launch import init_distributed, shutdown
    from pretrain.step_timing import NoTimer, StepTimer
    from pretrain.train_loop import Trainer

    modes = MODES + (ABLATIONS if args.ablate else ())
    cfg = load_config(None, [f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", "train.warmup_steps=1",
                             f"train.steps={len(modes) * (args.rounds + args.warmup) + 2}"])
    me, _, _, dev = init_distributed(600, "cpu")
    try:
        trainer = Trainer(cfg, device=dev)
        watch = CommWatch(64)
        watch.name_groups(trainer.groups.ranks)
        timers = {"off": NoTimer(), "on": StepTimer(watch, dev), "watch": NoTimer(), "timer": StepTimer(CommWatch(0), dev)}
        watched = {"on", "watch"}
        steps = iter(range(10**6))
        profiles = {m: cProfile.Profile() for m in modes} if args.cprofile == me else None

        def one(mode: str) -> tuple[float, float]:
            trainer.timer = timers[mode]
            dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            if profiles is not None:
                profiles[mode].enable()
            if mode in watched:
                with watch:
                    trainer.train_step(next(steps))
            else:
                trainer.train_step(next(steps))
            if profiles is not None:
                profiles[mode].disable()
            return time.perf_counter() - wall, time.thread_time() - cpu

        rows = []  # per round: {mode: (wall s slowest rank, cpu s summed)}
        for r in range(args.warmup + args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            got = {m: one(m) for m in order}
            wall = torch.tensor([got[m][0] for m in modes], dtype=torch.float64)
            cpu = torch.tensor([got[m][1] for m in modes], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)
            if r >= args.warmup:
                rows.append({m: (wall[i].item(), cpu[i].item()) for i, m in enumerate(modes)})
        if profiles is not None:
            for m in modes:
                out = io.StringIO()
                pstats.Stats(profiles[m], stream=out).sort_stats("tottime").print_stats(args.cprofile_top)
                print(f"==== rank {me} cProfile, mode {m}, {args.rounds + args.warmup} steps\n{out.getvalue()}", flush=True)
        return rows if me == 0 else None
    finally:
        shutdown()


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4f} [{min(xs):.4f},{max(xs):.4f}]"


def report(rows: list[dict], load_before, load_after) -> None:
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f}")
    off_ms = 1e3 * statistics.median(r["off"][0] for r in rows)
    for m in rows[0]:
        if m == "off":
            continue
        wall = [r[m][0] / r["off"][0] for r in rows]
        cpu = [r[m][1] / r["off"][1] for r in rows]
        print(f"RESULT {m} wall={_spread(wall)} cpu={_spread(cpu)} rounds={len(rows)} "
              f"{m}_ms={1e3 * statistics.median(r[m][0] for r in rows):.1f} off_ms={off_ms:.1f} "
              f"cpu_added_ms={1e3 * statistics.median(r[m][1] - r['off'][1] for r in rows):.2f}")


def per_call(pairs: int = 21, calls: int = 2000) -> None:
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
    p.add_argument("--rounds", "--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--ablate", action="store_true", help="Also the watch alone and the timer alone.")
    p.add_argument("--cprofile", type=int, default=-1, metavar="RANK", help="Print this rank's cProfile of each mode.")
    p.add_argument("--cprofile-top", type=int, default=25)
    p.add_argument("--per-call", action="store_true", help="Only the watch's cost per collective, in this process.")
    args = p.parse_args()
    if args.per_call:
        return per_call()
    from pretrain.launch import launch

    before = os.getloadavg()
    rows = launch(rank, (args,), nproc=args.tp * args.pp, device="cpu")[0]
    report(rows, before, os.getloadavg())


if __name__ == "__main__":
    main()
