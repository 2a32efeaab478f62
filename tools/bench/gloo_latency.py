"""What one small gloo collective costs on this machine: the floor under every multi-rank test.

    uv run python tools/bench/gloo_latency.py [--n 500]

Prints, per world size, the wall and CPU time of one 64-float ``all_reduce`` (median over ranks).
On the 2-core CI machine a layout test's time is about its message count times this.
"""

from __future__ import annotations

import argparse
import statistics
import time


def one_all_reduce(n: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    x = torch.zeros(64)
    for _ in range(20):  # warm-up: connections, first allocations
        dist.all_reduce(x)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        dist.all_reduce(x)
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def main() -> None:
    from par_groups.testing.harness import Harness

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="timed all-reduces per world size")
    args = parser.parse_args()
    harness = Harness()
    try:
        for world in (2, 4):
            results = harness.run(world, one_all_reduce, args.n, timeout=600)
            wall = statistics.median(r[0] for r in results) * 1e3
            cpu = statistics.median(r[1] for r in results) * 1e3
            print(f"RESULT gloo-all-reduce world={world} wall_ms={wall:.2f} cpu_ms_per_rank={cpu:.2f}")
    finally:
        harness.close()


if __name__ == "__main__":
    main()
