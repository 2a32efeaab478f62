"""Benchmark par-cp's context parallel modes against torch's context parallel (flex-attention path).

CPU, gloo, 4 ranks (cp=4; a2a+p2p as [2, 2]). Causal attention on the same shapes, forward +
backward per step. torch's CP on CPU only runs through flex-attention (its SDPA path has no CPU
sharding rule); that path all-gathers K/V and masks with a rewritten block mask, using its
head-tail (zigzag) load balancer. Ours use the zigzag layout.

    uv run python tools/bench/bench_cp.py [--seq 2048 --heads 8 --kv-heads 8 --dim 64 --iters 5]

Prints per-mode times, ratios and bytes per step (ours counted by par_groups.CommRecorder;
torch's all-gather + reduce-scatter counted from its tensor sizes) and ends with
``RESULT <mode> ratio=<ours/peer time> bytes=<bytes moved per step>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("p2p", "a2a", "allgather", "a2a+p2p")


def _time(step, iters: int) -> float:
    step()  # warm-up (and compilation for the peer)
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ours(args, groups, q, k, v, dout):
    from par_cp import ContextParallelAttention, shard_sequence
    from par_groups import CommRecorder

    rank, cp = groups.rank_in("cp"), groups.size("cp")
    local = [shard_sequence(t, rank, cp, layout="zigzag").requires_grad_() for t in (q, k, v)]
    grad = shard_sequence(dout, rank, cp, layout="zigzag")
    results = {}
    for mode in MODES:
        extra = {"inner_group": groups.hcp[0], "outer_group": groups.hcp[1]} if mode == "a2a+p2p" else {}
        attn = ContextParallelAttention(mode, groups.cp, causal=True, layout="zigzag", **extra)

        def forward():
            with torch.no_grad():
                attn(*local)

        def train_step():
            for t in local:
                t.grad = None
            attn(*local).backward(grad)

        with CommRecorder() as fwd_rec:
            forward()
        with CommRecorder() as step_rec:
            train_step()
        results[mode] = (_time(forward, args.iters), fwd_rec.total_bytes(), _time(train_step, args.iters), step_rec.total_bytes())
    return results


def _peer(args, mesh, q, k, v, dout):
    """torch context parallel, flex-attention path, causal, head-tail load balancing."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _context_parallel_shard, _ContextParallel, _create_cp_block_mask,
    )
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    class Flex(torch.nn.Module):
        def forward(self, query, key, value, block_mask):
            return compiled(query, key, value, block_mask=block_mask, enable_gqa=query.shape[1] != key.shape[1])

    attn = parallelize_module(Flex(), mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    seq = q.shape[0]
    balancer = _HeadTailLoadBalancer(seq, mesh.size(), torch.device("cpu"))
    block_mask = _create_cp_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, seq, seq, (128, 128), mesh, balancer)
    bhsd = [t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v, dout)]
    local = _context_parallel_shard(mesh, bhsd, [2, 2, 2, 2], balancer)

    def forward():  # flex-attention has no backward on CPU: forward only
        with torch.no_grad():
            attn(*local[:3], block_mask=block_mask)

    seconds = _time(forward, args.iters)
    return seconds, 2 * k.numel() * k.element_size()  # all-gather of the full K and V


def _worker(rank, world, init_file, args, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from par_groups import RankGrid, create_groups, device_mesh

    grid = RankGrid(world, cp=world, hcp=(2, world // 2))
    groups = create_groups(grid)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.seq, args.batch, args.heads, args.dim, generator=gen)
    k, v = (torch.randn(args.seq, args.batch, args.kv_heads, args.dim, generator=gen) for _ in range(2))
    dout = torch.randn(args.seq, args.batch, args.heads, args.dim, generator=gen)
    ours = _ours(args, groups, q, k, v, dout)
    mesh = device_mesh(grid)["cp"]
    try:
        peer = _peer(args, mesh, q, k, v, dout)
    except Exception as e:  # report, still print our numbers
        peer = (float("nan"), 0)
        if rank == 0:
            print(f"torch context parallel failed: {type(e).__name__}: {e}")
    if rank == 0:
        queue.put((ours, peer))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.world, os.path.join(tmp, "init"), args, queue), nprocs=args.world, start_method="spawn")
        ours, (peer_s, peer_bytes) = queue.get()
    print(f"cp={args.world} S={args.seq} B={args.batch} Hq={args.heads} Hkv={args.kv_heads} D={args.dim} causal, fp32, CPU gloo, "
          f"median of {args.iters} steps on rank 0. torch's flex-attention has no CPU backward, so the ratio compares "
          "forward steps; our fwd+bwd time and bytes are listed too.")
    print(f"{'torch CP (flex)':>16}: fwd {peer_s * 1e3:8.1f} ms  fwd bytes={peer_bytes}")
    for mode, (fs, fb, ts, tb) in ours.items():
        print(f"{mode:>16}: fwd {fs * 1e3:8.1f} ms  ratio={fs / peer_s:.2f}  fwd bytes={fb}   fwd+bwd {ts * 1e3:8.1f} ms  bytes={tb}")
    for mode, (fs, fb, ts, tb) in ours.items():
        print(f"RESULT {mode} ratio={fs / peer_s:.2f} bytes={fb} train_step_bytes={tb}")


if __name__ == "__main__":
    main()
