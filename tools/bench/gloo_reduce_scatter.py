"""par's reduce-scatter on gloo (an all-to-all and a local sum) against gloo's own (an all-reduce and a
copy), and an all-reduce of the same tensor for scale: one process per rank, paired and interleaved.

    uv run python tools/bench/gloo_reduce_scatter.py [--repeats 21] [--sizes 147840 893200 6000000] [--worlds 2 4]

Per world and input size (fp32 elements): each repeat runs ``par_groups.comm.reduce_scatter_tensor``
and ``torch.distributed.reduce_scatter_tensor`` back to back in alternating order (paired_timing),
each after a barrier, the slowest rank's time; ``ratio`` = par / gloo's, median [min, max] over the
repeats after the warm-up. Both results are checked equal (1e-6) before timing. Bytes each rank sends:
par's all-to-all (n-1)/n of the input (its CommRecorder count); gloo's ring all-reduce 2(n-1)/n.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from bench_zero import run_world
from commit import print_commit
from paired_timing import Summary, paired_times

from par_groups import CommRecorder, comm


def worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for size in args.sizes:
        n = size // world * world
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        ours, theirs, full = torch.empty(n // world), torch.empty(n // world), x.clone()
        with CommRecorder() as rec:
            comm.reduce_scatter_tensor(ours, x, None)
        dist.reduce_scatter_tensor(theirs, x)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        pairs = paired_times(lambda: comm.reduce_scatter_tensor(ours, x, None),
                             lambda: dist.reduce_scatter_tensor(theirs, x), args.repeats, args.warmup)
        reduce = [p[0] for p in paired_times(lambda: dist.all_reduce(full), lambda: None, args.repeats, args.warmup)]
        rows.append((world, n, Summary.of(pairs), statistics.median(reduce), rec.records[0].wire_bytes))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[147840, 893200, 6000000])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print_commit()
    print(f"{'world':>5} {'elements':>9} {'par ms':>7} {'gloo ms':>8} {'all_reduce ms':>13} {'ratio par/gloo':>22} "
          f"{'par sent MB':>11} {'gloo sent MB':>12}")
    results = []
    for world in args.worlds:
        for world_, n, s, reduce_s, sent in run_world(worker, world, args):
            ring = 2 * (world_ - 1) * n * 4 // world_
            print(f"{world_:5d} {n:9d} {s.ours_s * 1e3:7.2f} {s.peer_s * 1e3:8.2f} {reduce_s * 1e3:13.2f} "
                  f"{s.ratio:6.2f} [{s.ratio_min:.2f}, {s.ratio_max:.2f}]      {sent / 2**20:11.2f} {ring / 2**20:12.2f}")
            results.append((world_, n, s))
    for world, n, s in results:
        print(f"RESULT reduce_scatter-w{world}-n{n}-vs-gloo {s.spread()}")


if __name__ == "__main__":
    main()
