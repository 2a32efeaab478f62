"""par-pp vs torch.distributed.pipelining: same MLP chunks, same microbatches, CPU gloo, 4 ranks.

    uv run python tools/bench/bench_pp.py [--pp 4] [--microbatches 8] [--hidden 256] [--repeats 7]

Timing (``paired_timing``): ours and the peer alternate step by step in the same processes,
warm-up discarded, the slowest rank's time; ``ratio`` is the median of the per-repeat ratios
ours / peer, ``ratio_min`` / ``ratio_max`` their spread. Ours declares its message shape as the
trainer does (``message_shape``: no shape header per message; torch's stages infer theirs once). Bytes sent per rank per step: ours
recorded by ``par_groups.CommRecorder``, the peer's from its dispatched sends
(``torch_comm.TorchCommBytes``). Both sides hold the same stages per rank (``vpp``): zb-h1's peer is
torch's ScheduleInterleavedZeroBubble given one stage per rank (the ZB-H1 shape, the same bytes). The bubble is measured from par-pp's executed timeline. Ends with
``RESULT <schedule> ratio= ratio_min= ratio_max= repeats= bubble=<measured> bytes= peer_bytes=``.
"""

from __future__ import annotations

import argparse
import os

from commit import print_commit
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# (ours, vpp, torch schedule class name, torch stage placement)
PAIRS = [
    ("1f1b", 1, "Schedule1F1B", "loop"),
    ("interleaved", 2, "ScheduleInterleaved1F1B", "loop"),
    # torch's zero-bubble scheduler given one stage per rank: ZB-H1's shape (B/W split), our bytes
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble", "loop"),
    ("zb-v", 2, "ScheduleZBVZeroBubble", "v"),
    ("dualpipev", 2, "ScheduleDualPipeV", "v"),
]


def make_chunk(c: int, hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(c)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)])


def loss_fn(y, t):
    return (y - t).pow(2).mean()


def build_ours(name, vpp, pp, m, args, data):
    """One step of par-pp's executor, and a function measuring the bubble of one step."""
    from par_pp import PipelineExecutor, build_schedule, chunks_on_rank

    rank = dist.get_rank()
    schedule = build_schedule(name, pp, m, vpp)
    layers = args.layers_per_rank // schedule.vpp
    chunks = {c: make_chunk(c, args.hidden, layers) for c in chunks_on_rank(schedule, rank)}
    xs, ts = data
    # Every message's shape declared, as the trainer does (torch's stages infer theirs once).
    ex = PipelineExecutor(schedule, chunks, None, loss_fn=loss_fn, message_shape=(tuple(xs[0].shape), xs[0].dtype))

    def step():
        ex.step(xs, ts)

    def bubble() -> float:
        """Idle share of the step's span, from the executor's timeline, averaged over ranks."""
        step()
        rows = [None] * pp
        dist.all_gather_object(rows, [(r.start, r.end) for r in ex.records])
        begin, end = min(s for row in rows for s, _ in row), max(e for row in rows for _, e in row)
        return sum(1 - sum(e - s for s, e in row) / (end - begin) for row in rows) / pp

    return step, bubble


def build_peer(cls_name, vpp, placement, pp, m, args, data, group):
    """One step of torch's schedule with ``vpp`` stages per rank (as ours); its stages talk over
    ``group``, apart from our messages."""
    from torch.distributed import pipelining

    rank = dist.get_rank()
    per_rank = vpp
    stages_total = pp * per_rank
    if placement == "v":
        mine = [rank, 2 * pp - 1 - rank]
    else:
        mine = [rank + k * pp for k in range(per_rank)]
    layers = args.layers_per_rank // per_rank
    stages = [pipelining.PipelineStage(make_chunk(c, args.hidden, layers), c, stages_total, torch.device("cpu"))
              for c in mine]
    cls = getattr(pipelining, cls_name)
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    sched = cls(stages[0], m, loss_fn=loss_fn) if single else cls(stages, m, loss_fn=loss_fn)
    xs, ts = data
    x, t = torch.cat(xs, dim=1), torch.cat(ts, dim=1)  # microbatches split along the batch dim
    inputs = (x,) if 0 in mine else ()
    kwargs = {"target": t} if stages_total - 1 in mine else {}

    def step():
        sched.step(*inputs, **kwargs)

    return step


def _send_bytes(step, recorder) -> int:
    with recorder as rec:
        step()
    return sum(r.bytes for r in rec.records if r.op == "send")


def worker(rank, world, port, args, queue):
    from paired_timing import Summary, paired_times
    from torch_comm import TorchCommBytes

    from par_groups import CommRecorder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    m = args.microbatches
    xs = [torch.randn(args.seq, args.batch, args.hidden, generator=g) for _ in range(m)]
    ts = [torch.randn(args.seq, args.batch, args.hidden, generator=g) for _ in range(m)]
    peer_group = dist.new_group(list(range(world)))  # interleaved steps: keep the two sides' p2p apart
    for name, vpp, cls_name, placement in [p for p in PAIRS if p[0] in args.schedules]:
        ours, bubble = build_ours(name, vpp, world, m, args, (xs, ts))
        try:
            peer = build_peer(cls_name, vpp, placement, world, m, args, (xs, ts), peer_group)
            summary = Summary.of(paired_times(ours, peer, args.repeats, args.warmup))
            peer_bytes = _send_bytes(peer, TorchCommBytes())
        except Exception as e:  # report, keep benchmarking the others
            summary, peer_bytes = None, 0
            print(f"rank {rank}: peer {cls_name} failed: {type(e).__name__}: {e}", flush=True)
        measured = bubble()
        nbytes = _send_bytes(ours, CommRecorder())
        if rank == 0:
            queue.put((name, cls_name, summary, measured, nbytes, peer_bytes))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers-per-rank", type=int, default=4)
    p.add_argument("--schedules", nargs="+", default=[p[0] for p in PAIRS], choices=[p[0] for p in PAIRS])
    p.add_argument("--repeats", type=int, default=7, help="timed repeats (pairs of steps)")
    p.add_argument("--warmup", type=int, default=2, help="discarded repeats before them")
    args = p.parse_args()
    print_commit()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, args.pp, port, args, queue)) for r in range(args.pp)]
    for proc in procs:
        proc.start()
    results = [queue.get() for _ in args.schedules]
    for proc in procs:
        proc.join()
    print(f"pp={args.pp} microbatches={args.microbatches} hidden={args.hidden} seq={args.seq} batch={args.batch} "
          f"layers/rank={args.layers_per_rank} (CPU gloo); {args.repeats} paired repeats after {args.warmup} warm-up, "
          "slowest rank; ratio [min, max] of per-repeat ratios; bytes sent per rank per step")
    for name, cls_name, s, bubble, nbytes, peer_bytes in results:
        if s is None:
            print(f"{name:12s} peer {cls_name} failed")
            continue
        print(f"{name:12s} ours {s.ours_s * 1e3:8.1f} ms   {cls_name:30s} {s.peer_s * 1e3:8.1f} ms   ratio {s.ratio:5.2f} "
              f"[{s.ratio_min:.2f}, {s.ratio_max:.2f}]   bubble {bubble:.3f}   sent {nbytes / 1e6:.2f} MB, peer {peer_bytes / 1e6:.2f} MB")
    for name, _, s, bubble, nbytes, peer_bytes in results:
        if s is not None:
            print(f"RESULT {name} {s.spread()} bubble={bubble:.3f} bytes={nbytes} peer_bytes={peer_bytes}")


if __name__ == "__main__":
    main()
