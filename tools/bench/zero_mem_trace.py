"""Where par-zero's and FSDP2's memory goes: live tensor bytes by phase, and the blocks alive at the peak.

Counted from torch's CPU allocator (``alloc_trace.py``: the profiler's memory events, gloo's worker
threads included), over the baseline before the model is built. For each bench pair (same model,
batch and settings as bench_zero.py) it prints, for the rank with the highest peak, the peak live
bytes in each phase (build, forward, backward, step + zero_grad), the op running at the peak of
the steps, and with ``--detail N`` the N biggest blocks alive then (and which op allocated them).

    uv run python tools/bench/zero_mem_trace.py [--hidden 384] [--layers 6] [--bucket-mb 1] [--detail 8]
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist

from alloc_trace import PHASES, trace
from bench_zero import PAIRS, Runner, add_model_args, hsdp_groups, layer_mb, run_world


def worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=600))
    groups = hsdp_groups(rank, world)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, 16, generator=g)
    rows = []
    for ours, _, peer in PAIRS:
        if ours in ("no_shard", "optim"):
            continue
        row = [ours]
        for name in (ours, peer):
            t = trace(lambda: Runner(name, args, groups), x, y)
            tops = [None] * world
            dist.all_gather_object(tops, (t.peak, rank))
            highest = max(tops)[1]
            box = [t]
            dist.broadcast_object_list(box, src=highest)
            row += [name, box[0], highest]
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--detail", type=int, default=0, help="list this many of the biggest blocks live at each peak")
    args = ap.parse_args()
    args.bucket_mb = args.bucket_mb or layer_mb(args)
    rows = run_world(worker, 4, args)
    mb = lambda b: f"{b / 2**20:6.2f}"
    print(f"live tensor MB over the pre-build baseline, the highest rank (hidden {args.hidden}, layers {args.layers}, "
          f"bucket_mb {args.bucket_mb:.4f})")
    print(f"{'trainer':>20} {'rank':>4} " + " ".join(f"{p:>8}" for p in PHASES) + f" {'peak':>7} {'ratio':>6}  at")
    for _, ours, o, o_rank, peer, p, p_rank in rows:
        for name, t, r in ((ours, o, o_rank), (peer, p, p_rank)):
            ratio = f"{o.peak / max(p.peak, 1):6.3f}" if t is o else " " * 6
            print(f"{name:>20} {r:>4} " + " ".join(f"{mb(t.peaks[ph]):>8}" for ph in PHASES)
                  + f" {mb(t.peak)} {ratio}  {t.at}")
            for size, where in t.live[: args.detail]:
                print(f"{'':>26}{mb(size)} MB  {where}")


if __name__ == "__main__":
    main()
