"""par-pp vs torch.distributed.pipelining: same MLP chunks, same microbatches, CPU gloo, 4 ranks.

    uv run python tools/bench/bench_pp.py [--pp 4] [--microbatches 8] [--hidden 256] [--steps 3]

Prints step times (median), their ratio (ours / peer), bytes sent by par-pp (CommRecorder), the
bubble measured from par-pp's executed timeline, and ends with
``RESULT <schedule> ratio=<ours/peer step time> bubble=<measured>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# (ours, vpp, torch schedule class name, torch stage placement)
PAIRS = [
    ("1f1b", 1, "Schedule1F1B", "loop"),
    ("interleaved", 2, "ScheduleInterleaved1F1B", "loop"),
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble", "loop2"),  # torch's ZB needs >= 2 stages per rank
    ("zb-v", 2, "ScheduleZBVZeroBubble", "v"),
    ("dualpipev", 2, "ScheduleDualPipeV", "v"),
]


def make_chunk(c: int, hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(c)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)])


def loss_fn(y, t):
    return (y - t).pow(2).mean()


def run_ours(name, vpp, pp, m, args, data):
    from par_groups.comm import CommRecorder
    from par_pp import PipelineExecutor, build_schedule, chunks_on_rank

    rank = dist.get_rank()
    schedule = build_schedule(name, pp, m, vpp)
    layers = args.layers_per_rank // schedule.vpp
    chunks = {c: make_chunk(c, args.hidden, layers) for c in chunks_on_rank(schedule, rank)}
    ex = PipelineExecutor(schedule, chunks, None, loss_fn=loss_fn)
    xs, ts = data
    times, bubbles, nbytes = [], [], 0
    for i in range(args.steps + 1):
        dist.barrier()
        t = time.perf_counter()
        with CommRecorder() as rec:
            ex.step(xs, ts)
        dist.barrier()
        if i:  # step 0 warms up
            times.append(time.perf_counter() - t)
            rows = [None] * pp
            dist.all_gather_object(rows, [(r.start, r.end) for r in ex.records])
            begin, end = min(s for row in rows for s, _ in row), max(e for row in rows for _, e in row)
            bubbles.append(sum(1 - sum(e - s for s, e in row) / (end - begin) for row in rows) / pp)
            nbytes = rec.total_bytes("send")
    return statistics.median(times), statistics.median(bubbles), nbytes


def run_peer(cls_name, placement, pp, m, args, data):
    from torch.distributed import pipelining

    rank = dist.get_rank()
    per_rank = 1 if placement == "loop" and cls_name == "Schedule1F1B" else 2
    stages_total = pp * per_rank
    if placement == "v":
        mine = [rank, 2 * pp - 1 - rank]
    else:
        mine = [rank + k * pp for k in range(per_rank)]
    layers = args.layers_per_rank // per_rank
    stages = [pipelining.PipelineStage(make_chunk(c, args.hidden, layers), c, stages_total, torch.device("cpu")) for c in mine]
    cls = getattr(pipelining, cls_name)
    sched = cls(stages[0], m, loss_fn=loss_fn) if per_rank == 1 else cls(stages, m, loss_fn=loss_fn)
    xs, ts = data
    x, t = torch.cat(xs, dim=1), torch.cat(ts, dim=1)  # microbatches split along the batch dim
    times = []
    for i in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        holds_first, holds_last = 0 in mine, stages_total - 1 in mine
        kwargs = {"target": t} if holds_last else {}
        sched.step(*(x,) if holds_first else (), **kwargs)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    m = args.microbatches
    xs = [torch.randn(args.seq, args.batch, args.hidden, generator=g) for _ in range(m)]
    ts = [torch.randn(args.seq, args.batch, args.hidden, generator=g) for _ in range(m)]
    for name, vpp, cls_name, placement in PAIRS:
        ours, bubble, nbytes = run_ours(name, vpp, world, m, args, (xs, ts))
        try:
            peer = run_peer(cls_name, placement, world, m, args, (xs, ts))
        except Exception as e:  # report, keep benchmarking the others
            peer = float("nan")
            if rank == 0:
                print(f"peer {cls_name} failed: {type(e).__name__}: {e}", flush=True)
        if rank == 0:
            queue.put((name, cls_name, ours, peer, bubble, nbytes))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers-per-rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, args.pp, port, args, queue)) for r in range(args.pp)]
    for proc in procs:
        proc.start()
    results = [queue.get() for _ in PAIRS]
    for proc in procs:
        proc.join()
    print(f"pp={args.pp} microbatches={args.microbatches} hidden={args.hidden} seq={args.seq} batch={args.batch} layers/rank={args.layers_per_rank} (CPU gloo)")
    for name, cls_name, ours, peer, bubble, nbytes in results:
        print(f"{name:12s} ours {ours * 1e3:8.1f} ms   {cls_name:30s} {peer * 1e3:8.1f} ms   ratio {ours / peer:5.2f}   bubble {bubble:.3f}   sent {nbytes / 1e6:.2f} MB")
    for name, _, ours, peer, bubble, _ in results:
        print(f"RESULT {name} ratio={ours / peer:.2f} bubble={bubble:.3f}")


if __name__ == "__main__":
    main()
