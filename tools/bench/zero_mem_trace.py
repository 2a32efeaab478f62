"""Where par-zero's and FSDP2's memory goes: live bytes counted from torch's CPU allocator, by phase.

bench_zero.py's ``mem_ratio`` reads the RSS high-water mark, which also counts malloc's caching
and what is not a tensor. This counts tensor storage only: torch's profiler (``profile_memory``)
reports every CPU allocation and free with the allocator's running total of live bytes, across
threads (gloo's worker buffers included). For each bench pair (same model, same batch, same
settings as bench_zero.py) it prints, per rank 0, the peak live bytes over the baseline taken
before the model is built, in each phase: build, forward, backward, step (+ zero_grad), and the
op that was running at the overall peak.

    uv run python tools/bench/zero_mem_trace.py [--hidden 384] [--layers 6] [--bucket-mb 1]
"""

from __future__ import annotations

import argparse
import gc
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import profile, record_function

from bench_zero import PAIRS, Runner, add_model_args, hsdp_groups, layer_mb, run_world

PHASES = ("build", "forward", "backward", "step")


def _walk(events, phase=None, op=None):
    for e in events:
        name = e.name
        p = name if name in PHASES else phase
        o = op if e.tag == _EventType.Allocation or name in PHASES else name
        yield e, p, o
        yield from _walk(e.children, p, o)


def traced(name: str, args, groups, x, y) -> dict:
    """Peak live bytes per phase (build, then 2 steps) of one trainer, over the pre-build baseline."""
    gc.collect()
    with profile(profile_memory=True) as prof:
        with record_function("build"):
            r = Runner(name, args, groups)
        for _ in range(2):
            with record_function("forward"):
                loss = nn.functional.mse_loss(r.dp(x), y)
            with record_function("backward"):
                loss.backward()
            with record_function("step"):
                del loss
                (r.opt or r.dp).step()
                (r.opt or r.dp).zero_grad()
        del r
        gc.collect()
    allocs = [(e.start_time_ns, e.extra_fields.total_allocated - e.extra_fields.alloc_size, phase, op)
              for e, phase, op in _walk(prof.profiler.kineto_results.experimental_event_tree())
              if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    allocs.sort()
    base = allocs[0][1]  # live bytes before the first allocation of the build
    peaks = {p: 0 for p in PHASES}
    top = (0, None, None)
    for e, phase, op in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            live = e.extra_fields.total_allocated - base
            if phase in peaks:
                peaks[phase] = max(peaks[phase], live)
            if live > top[0]:
                top = (live, phase, op)
    return {"peaks": peaks, "peak": top[0], "at": f"{top[1]}/{top[2]}", "live": live_at_peak(prof, base, top[0])}


def live_at_peak(prof, base: int, peak: int) -> list[tuple[int, str]]:
    """The blocks live at the moment of the peak: (bytes, phase/op that allocated them), biggest first."""
    events = sorted(((e.start_time_ns, e.extra_fields, f"{phase}/{op}") for e, phase, op
                     in _walk(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"), key=lambda t: t[0])
    live = {}
    for _, f, where in events:
        if f.alloc_size > 0:
            live[f.ptr] = (f.alloc_size, where)
        else:
            live.pop(f.ptr, None)
        if f.total_allocated - base == peak:
            return sorted(live.values(), reverse=True)
    return []


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
        rows.append((ours, traced(ours, args, groups, x, y), peer, traced(peer, args, groups, x, y)))
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
    print(f"rank 0 live tensor MB over the pre-build baseline (hidden {args.hidden}, layers {args.layers}, "
          f"bucket_mb {args.bucket_mb})")
    print(f"{'trainer':>20} " + " ".join(f"{p:>8}" for p in PHASES) + f" {'peak':>7} {'ratio':>6}  at")
    for ours, o, peer, p in rows:
        for name, t in ((ours, o), (peer, p)):
            ratio = f"{o['peak'] / max(p['peak'], 1):6.3f}" if t is o else " " * 6
            print(f"{name:>20} " + " ".join(f"{mb(t['peaks'][ph]):>8}" for ph in PHASES)
                  + f" {mb(t['peak'])} {ratio}  {t['at']}")
            if args.detail:
                for size, where in t["live"][: args.detail]:
                    print(f"{'':>24}{mb(size)} MB  {where}")


if __name__ == "__main__":
    main()
