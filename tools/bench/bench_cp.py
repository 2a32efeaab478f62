"""Benchmark par-cp's context parallel modes: forward + backward against the ideal, forward against torch.

CPU, gloo, 4 ranks (cp=4; a2a+p2p as [2, 2]); causal attention, zigzag layout, fp32.

Forward + backward, every mode: torch's context parallel has no backward on the CPU (its SDPA
path has no CPU sharding rule, and flex-attention has no CPU backward), so the peer is the ideal
instead: torch's single-device SDPA forward + backward on the full sequence, its time divided by
cp (perfect split, no communication). Every rank runs that full-sequence step at the same time
as the others, so both sides share the machine the same way. ``ratio`` = ours / ideal.

Forward only, all-gather: against torch's context parallel on its flex-attention path (it
all-gathers K/V, masks with a rewritten block mask, head-tail load balancing), ``fwd_ratio``.

Timing (``paired_timing``): ours and the peer alternate step by step in the same processes,
warm-up discarded, the slowest rank's time; ratio = median of per-repeat ratios, with min/max.
Bytes per rank per step (``wire_bytes``): ours from ``par_groups.CommRecorder``. torch's flex
CP cannot be recorded: flex-attention compiles itself even when called eagerly, and torch.compile
refuses to run under a dispatch mode (CommDebugMode's or ours), so no peer bytes are reported.

    uv run python tools/bench/bench_cp.py [--seq 2048 --heads 8 --kv-heads 8 --dim 64 --repeats 7]

Ends with ``RESULT <mode> ratio= ratio_min= ratio_max= repeats= bytes=`` (fwd+bwd vs the ideal)
and ``RESULT allgather-fwd-vs-torch-flex ratio= ratio_min= ratio_max= repeats= bytes=``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_ranks import run_spawned
from commit import print_commit
from paired_timing import Summary, paired_times

MODES = ("p2p", "a2a", "allgather", "a2a+p2p")


def _ideal(q, k, v, dout, cp):
    """Single-device SDPA forward + backward on the full sequence; time / cp is the ideal CP step."""
    bhsd = [t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v, dout)]
    q_, k_, v_ = (t.requires_grad_() for t in bhsd[:3])
    gqa = q.shape[2] != k.shape[2]

    def step():
        for t in (q_, k_, v_):
            t.grad = None
        F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=gqa).backward(bhsd[3])

    return step


def _ours(groups, mode, q, k, v, dout):
    from par_cp import ContextParallelAttention, shard_sequence

    rank, cp = groups.rank_in("cp"), groups.size("cp")
    local = [shard_sequence(t, rank, cp, layout="zigzag").requires_grad_() for t in (q, k, v)]
    grad = shard_sequence(dout, rank, cp, layout="zigzag")
    extra = {"inner_group": groups.hcp[0], "outer_group": groups.hcp[1]} if mode == "a2a+p2p" else {}
    attn = ContextParallelAttention(mode, groups.cp, causal=True, layout="zigzag", **extra)

    def forward():
        with torch.no_grad():
            attn(*local)

    def train_step():
        for t in local:
            t.grad = None
        attn(*local).backward(grad)

    return forward, train_step


def _torch_flex_forward(mesh, q, k, v):
    """torch context parallel, flex-attention path, causal, head-tail load balancing (forward only)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _context_parallel_shard, _ContextParallel, _create_cp_block_mask,
    )
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    kernel = torch.compile(flex_attention, dynamic=False)

    class Flex(torch.nn.Module):
        def forward(self, query, key, value, block_mask):
            return kernel(query, key, value, block_mask=block_mask, enable_gqa=query.shape[1] != key.shape[1])

    attn = parallelize_module(Flex(), mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    seq = q.shape[0]
    balancer = _HeadTailLoadBalancer(seq, mesh.size(), torch.device("cpu"))
    block_mask = _create_cp_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, seq, seq, (128, 128), mesh, balancer)
    bhsd = [t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v)]
    local = _context_parallel_shard(mesh, bhsd, [2, 2, 2], balancer)

    def forward():
        with torch.no_grad():
            attn(*local, block_mask=block_mask)

    return forward


def _bytes(step, recorder) -> int:
    with recorder as rec:
        step()
    return sum(r.wire_bytes for r in rec.records)


def _measure(rank, world, args):
    from par_groups import CommRecorder, RankGrid, create_groups, device_mesh

    grid = RankGrid(world, cp=world, hcp=(2, world // 2))
    groups = create_groups(grid)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.seq, args.batch, args.heads, args.dim, generator=gen)
    k, v = (torch.randn(args.seq, args.batch, args.kv_heads, args.dim, generator=gen) for _ in range(2))
    dout = torch.randn(args.seq, args.batch, args.heads, args.dim, generator=gen)
    ideal = _ideal(q, k, v, dout, world)
    results = {}
    for mode in MODES:
        forward, train_step = _ours(groups, mode, q, k, v, dout)
        pairs = paired_times(train_step, ideal, args.repeats, args.warmup)
        results[mode] = (Summary.of([(o, p / world) for o, p in pairs]), _bytes(train_step, CommRecorder()))
        if mode == "allgather":
            try:
                flex = _torch_flex_forward(device_mesh(grid)["cp"], q, k, v)
                fwd = Summary.of(paired_times(forward, flex, args.repeats, args.warmup))
                results["allgather-fwd-vs-torch-flex"] = (fwd, _bytes(forward, CommRecorder()))
            except Exception as e:  # report, still print our numbers
                if rank == 0:
                    print(f"torch context parallel failed: {type(e).__name__}: {e}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7, help="timed repeats (pairs of steps)")
    p.add_argument("--warmup", type=int, default=2, help="discarded repeats before them")
    args = p.parse_args()
    print_commit()
    results = run_spawned(_measure, args.world, args)
    print(f"cp={args.world} S={args.seq} B={args.batch} Hq={args.heads} Hkv={args.kv_heads} D={args.dim} causal zigzag, fp32, "
          f"CPU gloo; {args.repeats} paired repeats after {args.warmup} warm-up, slowest rank. fwd+bwd peer: single-device "
          f"SDPA fwd+bwd on the full sequence / cp (torch CP has no CPU backward); fwd peer: torch CP (flex).")
    for name, (s, nbytes) in results.items():
        print(f"{name:>28}: ours {s.ours_s * 1e3:8.1f} ms  peer {s.peer_s * 1e3:8.1f} ms  ratio {s.ratio:.2f} "
              f"[{s.ratio_min:.2f}, {s.ratio_max:.2f}]  bytes/rank {nbytes}")
    for name, (s, nbytes) in results.items():
        print(f"RESULT {name} {s.spread()} bytes={nbytes}")


if __name__ == "__main__":
    main()
