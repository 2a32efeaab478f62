"""par-zero vs torch DDP / FSDP2 fully_shard (and HSDP on a 2-D mesh): step time, peak memory, bytes.

World 4, CPU gloo, one thread per rank. Each pair (ours, peer) trains the same MLP on the same
batch; a step is forward + backward + clip-free AdamW step.

Timing (``paired_timing``): ours and the peer alternate step by step in the same processes,
warm-up discarded, the slowest rank's time; ``ratio`` is the median of the per-repeat ratios
ours / peer, ``ratio_min`` / ``ratio_max`` their spread. Peak memory (``mem_ratio`` = ours / peer)
is the same measure on both sides: the highest live tensor bytes during ``--mem-steps`` steps after a warm-up one
(forward, backward, optimizer step, zero_grad), counted from torch's CPU allocator over the
baseline before the model is built (``alloc_trace.py``: the profiler's memory events, so the
buffers gloo allocates on its own threads count too), on the rank where it is highest. It
includes the model state (params, grads, optimizer moments), not the batch nor malloc's caching.
Bytes per rank per step (``wire_bytes``, ring algorithms): ours recorded by
``par_groups.CommRecorder``, the peer's from its dispatched collectives (``torch_comm.TorchCommBytes``).

    uv run python tools/bench/bench_zero.py [--repeats 7] [--hidden 384] [--layers 6] [--bucket-mb MB] [--overlap-comm on]
        [--only no_shard optim]

Ours runs with its defaults: on the CPU ``overlap_comm`` is off (par_zero.DataParallel: ZeRO-3
prefetches a unit once the current one is freed; a bucket's grads wait for room among the
reductions in flight); ``--overlap-comm on`` gives the overlapping order instead.

Granularity: FSDP2 shards, gathers and reduce-scatters per layer, so ours (ZeRO-3: a gather unit
per layer) and DDP get buckets of one layer by default (``--bucket-mb``). ``zero_mem_trace.py``
splits the same peaks by phase and lists the blocks alive at them.

Collectives: the same counts and bytes on both sides, but not the same algorithms on gloo. ZeRO-1's
reduce-scatter is ``par_groups.comm``'s all-to-all and local sum (gloo's own, which DDP does not use
and FSDP2 does, is an all-reduce and a copy); ZeRO-2/3 keep gloo's own, which holds no transient
of the bucket's size (``spare_memory``).

Ends with ``RESULT <strategy>-vs-<peer> ratio= ratio_min= ratio_max= ci95=<the median's 95 % CI>
repeats= mem_ratio=<ours/peer peak bytes> bytes= peer_bytes=``.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from alloc_trace import trace
from commit import print_commit
from paired_timing import Summary, paired_times
from torch_comm import TorchCommBytes

from par_groups import CommRecorder
from par_zero import data_parallel

PAIRS = [  # (our strategy, our kwargs, peer name)
    ("no_shard", {}, "ddp"),
    ("optim", {}, "ddp"),
    ("optim_grads", {}, "fsdp2_noreshard"),  # the explainer's ZeRO-2-like FSDP2 toggle
    ("optim_grads_params", {}, "fsdp2"),
    ("hsdp", {}, "fsdp2_hsdp"),
]


def make_model(hidden: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(hidden, 16))


class Runner:
    """One trainer (ours or the peer) with a uniform step()."""

    def __init__(self, name: str, args, groups):
        self.name = name
        model = make_model(args.hidden, args.layers)
        inner, outer = groups
        kw = dict(lr=1e-3)
        ours = dict(bucket_mb=args.bucket_mb, overlap_comm={"auto": None, "on": True, "off": False}[args.overlap_comm])
        if name in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
            self.dp = data_parallel(model, None, name, **ours, **kw)
            self.opt = None
        elif name == "hsdp":
            self.dp = data_parallel(model, inner, "optim_grads_params", outer_group=outer, **ours, **kw)
            self.opt = None
        elif name == "ddp":
            self.dp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
            self.opt = torch.optim.AdamW(model.parameters(), foreach=False, **kw)
        elif name in ("fsdp2", "fsdp2_hsdp", "fsdp2_noreshard"):
            self.dp = data_parallel(model, inner if name == "fsdp2_hsdp" else None, "torch_fsdp2",
                                   outer_group=outer if name == "fsdp2_hsdp" else None,
                                   reshard_after_forward=name != "fsdp2_noreshard", **kw)
            self.opt = None
        else:
            raise ValueError(name)

    def step(self, x, y) -> None:
        loss = nn.functional.mse_loss(self.dp(x), y)
        loss.backward()
        if self.opt is None:
            self.dp.step()
            self.dp.zero_grad()
        else:
            self.opt.step()
            self.opt.zero_grad()


def highest_peak(name, args, groups, x, y) -> int:
    """Peak live tensor bytes of ``name`` over ``args.mem_steps`` steps, the highest over the ranks."""
    peak = torch.tensor(trace(lambda: Runner(name, args, groups), x, y, args.mem_steps).peak, dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def hsdp_groups(rank: int, world: int):
    """(inner, outer) of this rank for HSDP: inner pairs {0,1},{2,3}; outer {0,2},{1,3}."""
    inner = outer = None
    for start in range(0, world, 2):
        g = dist.new_group([start, start + 1])
        inner = g if start <= rank < start + 2 else inner
    for k in range(2):
        g = dist.new_group(list(range(k, world, 2)))
        outer = g if rank % 2 == k else outer
    return inner, outer


def layer_mb(args) -> float:
    """One Linear(hidden, hidden)'s fp32 MB: FSDP2 shards and reduces per layer, so ours buckets alike."""
    return (args.hidden + 1) * args.hidden * 4 / 2**20


def worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    groups = hsdp_groups(rank, world)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, 16, generator=g)
    rows = []
    for ours, _, peer in [p for p in PAIRS if args.only is None or p[0] in args.only]:
        runners = [Runner(ours, args, groups), Runner(peer, args, groups)]
        steps = [lambda r=r: r.step(x, y) for r in runners]
        summary = Summary.of(paired_times(*steps, args.repeats, args.warmup))
        with CommRecorder() as rec:
            steps[0]()
        with TorchCommBytes() as peer_comm:
            steps[1]()
        del runners
        mem = [highest_peak(n, args, groups, x, y) for n in (ours, peer)]
        rows.append((ours, peer, summary, mem[0], mem[1], sum(r.wire_bytes for r in rec.records), peer_comm.wire_bytes()))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="bucket size of ours and DDP (default: one layer's fp32 bytes, FSDP2's unit)")
    ap.add_argument("--overlap-comm", choices=("auto", "on", "off"), default="auto",
                    help="ours' overlap_comm (auto: off on the CPU; on: prefetch before compute, as before 2026-12-01)")


def run_world(worker, world: int, args):
    """Run ``worker(rank, world, port, args, queue)`` on ``world`` spawned ranks; rank 0's rows."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats (pairs of steps)")
    ap.add_argument("--warmup", type=int, default=2, help="discarded repeats before them")
    ap.add_argument("--mem-steps", type=int, default=2, help="steps whose peak memory is measured (after a warm-up one)")
    ap.add_argument("--only", nargs="+", choices=[p[0] for p in PAIRS], default=None, help="run only these of ours")
    add_model_args(ap)
    args = ap.parse_args()
    print_commit()
    args.bucket_mb = args.bucket_mb or layer_mb(args)
    world = 4
    rows = run_world(worker, world, args)
    n = sum(p.numel() for p in make_model(args.hidden, args.layers).parameters())
    print(f"model: {args.layers}x Linear({args.hidden},{args.hidden}) + head = {n} params; world {world}, gloo, "
          f"batch {args.batch}/rank, bucket_mb {args.bucket_mb:.4f}")
    print(f"{args.repeats} paired repeats after {args.warmup} warm-up, slowest rank; ratio [min, max] of per-repeat ratios")
    print(f"{'ours':>20} {'peer':>16} {'ours ms':>8} {'peer ms':>8} {'ratio':>18} {'ours MB':>8} {'peer MB':>8} "
          f"{'ours comm MB':>12} {'peer comm MB':>12}")
    for ours, peer, s, m0, m1, c0, c1 in rows:
        print(f"{ours:>20} {peer:>16} {s.ours_s * 1e3:8.1f} {s.peer_s * 1e3:8.1f} {s.ratio:6.2f} [{s.ratio_min:.2f}, "
              f"{s.ratio_max:.2f}] {m0 / 2**20:8.2f} {m1 / 2**20:8.2f} {c0 / 2**20:12.2f} {c1 / 2**20:12.2f}")
    for ours, peer, s, m0, m1, c0, c1 in rows:
        print(f"RESULT {ours}-vs-{peer} {s.spread()} mem_ratio={m0 / max(m1, 1):.3f} bytes={c0} peer_bytes={c1}")


if __name__ == "__main__":
    main()
