"""par-zero vs torch DDP / FSDP2 fully_shard (and HSDP on a 2-D mesh): step time and peak memory.

World 4, CPU gloo, one thread per rank. Each pair (ours, peer) trains the same MLP on the same
batch; their iterations are interleaved so machine noise hits both alike; the figure is the
median step time (forward + backward + clip-free AdamW step). Peak memory is the rise of the
rank's resident-set high-water mark (/proc VmHWM, reset before each measured run; malloc's mmap
threshold pinned so freed tensors go back to the OS) over its RSS before building the model.
Bytes communicated per step by our wrapper are counted with par_groups.CommRecorder.

    uv run python tools/bench/bench_zero.py [--iters 8] [--hidden 384] [--layers 6]

Ends with ``RESULT <strategy>-vs-<peer> ratio=<ours/peer time> mem_ratio=<ours/peer peak bytes>``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from datetime import timedelta

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed big tensors leave RSS at once

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

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


def rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


class Runner:
    """One trainer (ours or the peer) with a uniform step()."""

    def __init__(self, name: str, args, groups):
        self.name = name
        model = make_model(args.hidden, args.layers)
        inner, outer = groups
        kw = dict(lr=1e-3)
        if name in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
            self.dp = data_parallel(model, None, name, bucket_mb=args.bucket_mb, **kw)
            self.opt = None
        elif name == "hsdp":
            self.dp = data_parallel(model, inner, "optim_grads_params", outer_group=outer, bucket_mb=args.bucket_mb, **kw)
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


def peak_bytes(name, args, groups, x, y) -> int:
    gc.collect()
    base = rss("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
    r = Runner(name, args, groups)
    for _ in range(2):
        r.step(x, y)
    peak = rss("VmHWM") - base
    del r
    gc.collect()
    return peak


def worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    inner = outer = None
    for start in range(0, world, 2):  # HSDP: inner pairs {0,1},{2,3}; outer {0,2},{1,3}
        g = dist.new_group([start, start + 1])
        inner = g if start <= rank < start + 2 else inner
    for k in range(2):
        g = dist.new_group(list(range(k, world, 2)))
        outer = g if rank % 2 == k else outer
    groups = (inner, outer)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, 16, generator=g)
    rows = []
    for ours, _, peer in PAIRS:
        runners = [Runner(ours, args, groups), Runner(peer, args, groups)]
        for r in runners:
            r.step(x, y)  # warm-up
        times = ([], [])
        for _ in range(args.iters):
            for k, r in enumerate(runners):
                dist.barrier()
                t = time.perf_counter()
                r.step(x, y)
                times[k].append(time.perf_counter() - t)
        with CommRecorder() as rec:
            runners[0].step(x, y)
        del runners
        # alternate and keep each one's smaller peak, so neither profits from the other's freed heap
        peaks = [peak_bytes(n, args, groups, x, y) for n in (peer, ours, peer, ours)]
        mem = [min(peaks[1], peaks[3]), min(peaks[0], peaks[2])]
        rows.append((ours, peer, statistics.median(times[0]), statistics.median(times[1]), mem[0], mem[1], rec.total_bytes()))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    args = ap.parse_args()
    world = 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    n = sum(p.numel() for p in make_model(args.hidden, args.layers).parameters())
    print(f"model: {args.layers}x Linear({args.hidden},{args.hidden}) + head = {n} params; world {world}, gloo, batch {args.batch}/rank")
    print(f"{'ours':>20} {'peer':>11} {'ours ms':>8} {'peer ms':>8} {'ours MB':>8} {'peer MB':>8} {'ours comm MB/step':>18}")
    for ours, peer, t0, t1, m0, m1, c in rows:
        print(f"{ours:>20} {peer:>11} {t0 * 1e3:8.1f} {t1 * 1e3:8.1f} {m0 / 2**20:8.2f} {m1 / 2**20:8.2f} {c / 2**20:18.2f}")
    for ours, peer, t0, t1, m0, m1, _ in rows:
        print(f"RESULT {ours}-vs-{peer} ratio={t0 / t1:.3f} mem_ratio={m0 / max(m1, 1):.3f}")


if __name__ == "__main__":
    main()
