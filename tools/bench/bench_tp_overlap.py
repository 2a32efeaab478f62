"""Async TP: a sequence-parallel par-tp block with ``comm_overlap`` (ring p2p under the matmuls)
against the same block with one collective per entry/exit, CPU gloo.

Both blocks hold the same weights; forward + backward timed with ``paired_timing`` (interleaved,
warm-up discarded, the slowest rank's time, median ratio with min/max). Bytes per rank per step
from ``par_groups.CommRecorder`` on both sides (the ring moves what the collectives move).

    uv run python tools/bench/bench_tp_overlap.py [--tp 2] [--seq 512] [--hidden 512] [--repeats 7]

Ends with ``RESULT tp<N>-overlap ratio= ratio_min= ratio_max= bytes= peer_bytes=``. On a CPU the
matmuls and gloo's transfers share the same cores, so the overlap gain is bounded by them; on
GPUs the transfer runs on the NIC / NVLink while the SMs multiply.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from commit import print_commit  # noqa: E402
from paired_timing import Summary, paired_times  # noqa: E402


def worker(rank: int, world: int, port: int, args, queue) -> None:
    from par_groups import CommRecorder
    from par_tp.testing import TPTransformerBlock

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    blocks = []
    for overlap in (True, False):
        torch.manual_seed(0)
        blocks.append(TPTransformerBlock(args.hidden, 8, 4, 3 * args.hidden, group, sequence_parallel=True,
                                         comm_overlap=overlap))
    blocks[1].load_state_dict(blocks[0].state_dict())
    x = torch.randn(args.seq // world, 2, args.hidden, generator=torch.Generator().manual_seed(rank))

    def step(block):
        def run():
            block(x.clone().requires_grad_(True)).pow(2).mean().backward()
        return run

    nbytes = []
    for block in blocks:
        with CommRecorder() as rec:
            step(block)()
        nbytes.append(sum(r.wire_bytes for r in rec.records))
    summary = Summary.of(paired_times(step(blocks[0]), step(blocks[1]), repeats=args.repeats, warmup=2))
    if rank == 0:
        queue.put((summary, nbytes))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print_commit()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29600 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, args.tp, port, args, queue)) for r in range(args.tp)]
    for p in procs:
        p.start()
    summary, (ours, peer) = queue.get()
    for p in procs:
        p.join()
    print(f"tp={args.tp} seq={args.seq} hidden={args.hidden}: overlap {1e3 * summary.ours_s:.1f} ms, "
          f"collectives {1e3 * summary.peer_s:.1f} ms (medians), wire bytes/rank/step {ours} vs {peer}")
    print(f"RESULT tp{args.tp}-overlap {summary.spread()} bytes={ours} peer_bytes={peer}")


if __name__ == "__main__":
    main()
