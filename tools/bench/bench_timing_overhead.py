"""What watching a step costs: the trainer's step with the step timing and flight recorder on
(``[log] timing = true``, ``flight_records = 64``: a ``CommWatch`` over every collective, a
``StepTimer``, its all-gather) against the same step with both off, tp2 x pp2 on 4 CPU gloo ranks.

    uv run python tools/bench/bench_timing_overhead.py [--rounds 30] [--warmup 4] [--block 2] [--tp 2] [--pp 2]
    uv run python tools/bench/bench_timing_overhead.py --ablate     # also the watch alone, the timer alone, off again
    uv run python tools/bench/bench_timing_overhead.py --cprofile 0 # rank 0's profile of each mode

The same trainer in the same processes runs every mode once per round, ``block`` steps back to
back (as in a run: no barrier between them, so a collective the timing adds can hold ranks
together where they would drift), the order of the modes rotated from round to round (no mode
always first after one that warms or cools a cache); each block starts after a barrier. Per
block: its wall time per step, from the first rank's start to the last rank's end on the host's
one clock (CLOCK_MONOTONIC), and its CPU time per step (the main threads' CPU time summed over
the ranks: compute and Python work without the waiting, which moves less with the load; gloo's
own threads are not in it). The first ``warmup`` rounds are discarded. Per mode the figures are
the medians [min, max] of the per-round ratios mode / off: a load that slows one round slows
every mode of it alike. The load average before and after is printed with them.

``own`` is the figure this bench gave before: each rank's own time, the slowest rank's taken. It
does not compare like with like: the timer's all-gather makes every rank end with the last one,
so with timing on the slowest own time also holds the gap between the ranks leaving the barrier
(printed; 1-4 ms median, at most 11-79 ms, on 2 busy cores), with timing off it does not.
``off_again`` (with ``--ablate``) runs "off" a second time: the spread of its ratio is the
bench's own noise on the machine it ran on.

Lines: ``RESULT <mode> ratio= ratio_min= ratio_max= cpu= cpu_min= cpu_max= own= ... rounds=
<mode>_ms= off_ms= cpu_added_ms=`` (``ratio``: the wall-clock one). Then, counted
on rank 0 (robust to the load): one watched step's calls (blocking and point-to-point), the
watch's own time per call around a no-op (the minimum of 15 x 2000), and the timer's all-gather
(20 back to back): ``RESULT counted calls= blocking_us= p2p_us= gather_ms= added_ms= share=``
(added time / the median watched step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import sys

sys.path.insert(0, os.path.dirname(__file__))
from commit import print_commit  # noqa: E402

MODES = ("off", "on")
# the watch alone (no timer, no all-gather); the timer alone (unwatched); "off" again: what the
# bench itself makes of two identical modes (its ratio should be 1 within the spread)
ABLATIONS = ("watch", "timer", "off_again")


def rank(args) -> dict | None:
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist

    from par_groups.watch import CommWatch
    from pretrain.config import load_config
    from pretrain.runtime.launch import init_distributed, shutdown
    from pretrain.observe.step_timing import NoTimer, StepTimer
    from pretrain.training.train_loop import Trainer

    modes = MODES + (ABLATIONS if args.ablate else ())
    cfg = load_config(None, [f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", "train.warmup_steps=1",
                             f"train.steps={len(modes) * (args.rounds + args.warmup) * args.block + 2}"])
    me, _, _, dev = init_distributed(600, "cpu")
    try:
        trainer = Trainer(cfg, device=dev)
        watch = CommWatch(64)
        watch.name_groups(trainer.groups.ranks)
        timers = {"off": NoTimer(), "on": StepTimer(watch, dev), "watch": NoTimer(), "timer": StepTimer(CommWatch(0), dev),
                  "off_again": NoTimer()}
        watched = {"on", "watch"}
        steps = iter(range(10**6))
        profiles = {m: cProfile.Profile() for m in modes} if args.cprofile == me else None

        def one(mode: str) -> list[float]:
            trainer.timer = timers[mode]
            dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()  # perf_counter: CLOCK_MONOTONIC, one clock for the host
            if profiles is not None:
                profiles[mode].enable()
            for _ in range(args.block):  # back to back, as in a run: ranks may drift apart within a block
                if mode in watched:
                    with watch:
                        trainer.train_step(next(steps))
                else:
                    trainer.train_step(next(steps))
            if profiles is not None:
                profiles[mode].disable()
            end = time.perf_counter()
            return [-wall, wall, end, end - wall, time.thread_time() - cpu]

        rows = []  # per round: {mode: (wall s per step, cpu s per step summed over ranks, own s, skew s)}
        for r in range(args.warmup + args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            got = {m: one(m) for m in order}
            times = torch.tensor([got[m][:4] for m in modes], dtype=torch.float64)
            cpu = torch.tensor([got[m][4] for m in modes], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # first start (negated), last start, last end, slowest own
            dist.all_reduce(cpu)
            if r >= args.warmup:
                k = args.block
                rows.append({m: ((t[2] + t[0]).item() / k, cpu[i].item() / k, t[3].item() / k, (t[1] + t[0]).item())
                             for i, (m, t) in enumerate(zip(modes, times))})
        if profiles is not None:
            for m in modes:
                out = io.StringIO()
                pstats.Stats(profiles[m], stream=out).sort_stats("tottime").print_stats(args.cprofile_top)
                print(f"==== rank {me} cProfile, mode {m}, {args.rounds + args.warmup} steps\n{out.getvalue()}", flush=True)
        use = counted(trainer, timers["on"], next(steps))
        dist.barrier()
        if me == 0:
            use["blocking_us"], use["p2p_us"] = bookkeeping_us(CommWatch(64))
        dist.barrier()
        return (rows, use) if me == 0 else None
    finally:
        shutdown()


def _spread(name: str, xs: list[float]) -> str:
    """``name=median name_min= name_max=`` (run_all.py reads ``ratio``, ``ratio_min``, ``ratio_max``)."""
    return f"{name}={statistics.median(xs):.4f} {name}_min={min(xs):.4f} {name}_max={max(xs):.4f}"


def report(rows: list[dict], load_before, load_after) -> None:
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f}")
    off_ms = 1e3 * statistics.median(r["off"][0] for r in rows)
    skew = [1e3 * r[m][3] for r in rows for m in r]
    print(f"ranks leave the barrier {statistics.median(skew):.1f} ms apart (median; max {max(skew):.1f})")
    for m in rows[0]:
        if m == "off":
            continue
        wall = [r[m][0] / r["off"][0] for r in rows]
        cpu = [r[m][1] / r["off"][1] for r in rows]
        own = [r[m][2] / r["off"][2] for r in rows]
        print(f"RESULT {m} {_spread('ratio', wall)} {_spread('cpu', cpu)} {_spread('own', own)} rounds={len(rows)} "
              f"{m}_ms={1e3 * statistics.median(r[m][0] for r in rows):.1f} off_ms={off_ms:.1f} "
              f"cpu_added_ms={1e3 * statistics.median(r[m][1] - r['off'][1] for r in rows):.2f}")


def bookkeeping_us(watch, repeats: int = 15, calls: int = 2000) -> tuple[float, float]:
    """The watch's own time per call, around a no-op instead of a collective: a blocking call and a
    point-to-point batch (wrapped work, waited). The minimum over repeats: what the code costs
    when the CPU is not taken away from it."""
    class Done:
        def wait(self):
            return True

    def loop(async_op: bool) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            if async_op:
                for w in watch.run(watch.begin("recv", None, 64, 0), lambda: [Done()], True):
                    w.wait()
            else:
                watch.run(watch.begin("all_reduce", None, 64), lambda: None, False)
        return (time.perf_counter() - start) / calls

    return tuple(1e6 * min(loop(a) for _ in range(repeats)) for a in (False, True))


def counted(trainer, timer, step: int) -> dict:
    """One watched step on this rank: its calls (blocking, point-to-point), its step time, and the
    timer's all-gather alone (20 back to back, per call)."""
    import torch.distributed as dist

    from par_groups.watch import P2P, CommWatch

    trainer.timer = timer
    with CommWatch(10**6) as everything:
        timer.watch = everything
        t0 = time.perf_counter()
        trainer.train_step(step)
        step_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            timer.finish()
        gather_s = (time.perf_counter() - t0) / 20
    ops = [e.op for e in everything.entries]
    return {"blocking": sum(op not in P2P for op in ops), "p2p": sum(op in P2P for op in ops), "step_s": step_s,
            "gather_s": gather_s}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", "--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--block", type=int, default=2, help="Steps each mode runs back to back per round.")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--ablate", action="store_true", help="Also the watch alone and the timer alone.")
    p.add_argument("--cprofile", type=int, default=-1, metavar="RANK", help="Print this rank's cProfile of each mode.")
    p.add_argument("--cprofile-top", type=int, default=25)
    args = p.parse_args()
    print_commit()
    from pretrain.runtime.launch import launch

    before = os.getloadavg()
    rows, use = launch(rank, (args,), nproc=args.tp * args.pp, device="cpu")[0]
    report(rows, before, os.getloadavg())
    added_ms = (use["blocking"] * use["blocking_us"] + use["p2p"] * use["p2p_us"]) / 1e3 + 1e3 * use["gather_s"]
    step_ms = 1e3 * statistics.median(r["on"][0] for r in rows)
    print(f"RESULT counted calls={use['blocking']}+{use['p2p']}p2p blocking_us={use['blocking_us']:.2f} "
          f"p2p_us={use['p2p_us']:.2f} gather_ms={1e3 * use['gather_s']:.2f} added_ms={added_ms:.2f} "
          f"share={added_ms / step_ms:.4f} (rank 0, of the median step {step_ms:.0f} ms)")


if __name__ == "__main__":
    main()
