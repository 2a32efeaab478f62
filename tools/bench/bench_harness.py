"""How long the multi-rank test harness takes: pool start-up, then 100 small jobs on 4 ranks.

    uv run python tools/bench/bench_harness.py [--world 4] [--jobs 100]

Each job is a small all-reduce on every rank (what a tiny multi-rank test does), run on the
reused worker pool; compare with the start-up cost a spawn-per-test design would pay each time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from commit import print_commit
from par_groups.testing import RankPool


def small_job(i: int) -> float:
    t = torch.full((16,), float(i + dist.get_rank()))
    dist.all_reduce(t)
    return t[0].item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=100)
    args = ap.parse_args()
    print_commit()
    t0 = time.perf_counter()
    pool = RankPool(args.world)
    pool.run(small_job, 0)
    startup = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(args.jobs):
        out = pool.run(small_job, i)
        assert out[0] == sum(i + r for r in range(args.world))
    jobs = time.perf_counter() - t1
    pool.close()
    print(f"pool start-up (world {args.world}, first job): {startup:.1f} s")
    print(f"{args.jobs} small jobs on {args.world} ranks: {jobs:.2f} s ({1000 * jobs / args.jobs:.1f} ms per job)")
    print(f"RESULT harness-world{args.world} startup_s={startup:.1f} per_job_ms={1000 * jobs / args.jobs:.1f} "
          f"spawn_per_test_ratio={(startup * args.jobs) / max(jobs, 1e-9):.0f}")


if __name__ == "__main__":
    main()
