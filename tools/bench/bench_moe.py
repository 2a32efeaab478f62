"""Benchmark par-moe's dispatch + grouped experts + combine against a naive per-expert loop.

CPU, gloo, 4 ranks; ep = 2 (expert DP 2) and ep = 4; both dispatchers. The same fixed routing
(top-k of a mildly skewed random router) and the same expert weights on both sides; one step is
forward + backward. The naive peer is what one writes first: all-gather the EP group's tokens,
loop over the local experts with a boolean mask each, weighted-add, reduce-scatter.

Timing (``paired_timing``): ours and the peer alternate step by step in the same processes,
warm-up repeats discarded, each step's time the slowest rank's; ``ratio`` is the median of the
per-repeat ratios ours / peer, ``ratio_min`` / ``ratio_max`` their spread.

Bytes: every collective of one step (forward + backward) of each side goes through
``par_groups.comm`` and is recorded; a rank's bytes are what it sends to other ranks
(``wire_bytes``: an all-to-all's off-rank split sizes, (n-1)/n of an all-gather or reduce-scatter),
averaged over the ranks. The minimum is the routing's: each token sent once to each other EP
rank holding any of its experts and its result sent back once, forward and again backward
(2 x 2 x rows x hidden x 4 B). ``bytes_ratio`` is ours / that minimum, ``peer_bytes_ratio`` the
naive loop's.

    uv run python tools/bench/bench_moe.py [--tokens 256 --hidden 256 --ffn 256 --experts 64 --top-k 8 --repeats 7]

Ends with ``RESULT <dispatcher>-ep<N> ratio=<median ours/naive> ratio_min= ratio_max= repeats=
bytes_ratio=<moved/minimum> peer_bytes_ratio=``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from commit import print_commit
from paired_timing import Summary, paired_times

DISPATCHERS = ("alltoall", "allgather")


def naive_moe(x, indices, weights, experts, first, ep_group):
    """All-gather tokens, loop over local experts with a mask each, reduce-scatter."""
    from par_groups import comm

    def gather(t):
        out = t.new_empty((t.shape[0] * dist.get_world_size(ep_group), *t.shape[1:]))
        comm.all_gather_into_tensor(out, t.contiguous(), ep_group)
        return out

    xs = gather(x.detach()).requires_grad_(x.requires_grad)
    idx, w = gather(indices), gather(weights.detach())
    y = torch.zeros_like(xs)
    for e in range(experts.w_gate.shape[0]):
        hit = idx == first + e
        token = hit.any(-1).nonzero().squeeze(1)
        if token.numel() == 0:
            continue
        t = xs[token]
        out = F.linear(F.silu(F.linear(t, experts.w_gate[e])) * F.linear(t, experts.w_up[e]), experts.w_down[e])
        y = y.index_add(0, token, out * (w[token] * hit[token]).sum(-1, keepdim=True))
    out = torch.empty_like(x)
    comm.reduce_scatter_tensor(out, y.detach().contiguous(), ep_group)
    return out, y, xs, gather


def minimum_bytes(indices, experts_per_rank, me, ep_group, hidden):
    """This rank's share of the routing's minimum for one step (see the module docstring)."""
    ep = dist.get_world_size(ep_group)
    needs = torch.zeros(indices.shape[0], ep, dtype=torch.bool).scatter_(1, indices // experts_per_rank, True)
    needs[:, me] = False
    rows_out = needs.sum(0)  # rows this rank sends to each other rank
    rows_in = torch.empty_like(rows_out)
    dist.all_to_all_single(rows_in, rows_out, group=ep_group)
    return 2 * (rows_out.sum() + rows_in.sum()).item() * hidden * 4


def mean_over_ranks(value: float) -> float:
    t = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _worker(rank, world, init_file, args, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from par_groups import CommRecorder, RankGrid, comm, create_groups
    from par_moe import GroupedSwiGLU, make_dispatcher

    T, H, Fh, E, K = args.tokens, args.hidden, args.ffn, args.experts, args.top_k
    results = {}
    for ep in (2, 4):
        pg = create_groups(RankGrid(world, ep=ep))
        local, me = E // ep, pg.rank_in("ep")
        first = me * local
        torch.manual_seed(1234 + first)  # experts depend on the expert id only
        experts = GroupedSwiGLU(local, H, Fh)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=gen).requires_grad_()
        skew = torch.linspace(0, 1, E)  # mildly unbalanced load, as real routers are
        logits = torch.randn(T, E, generator=gen) + skew
        top = logits.softmax(-1).topk(K, dim=-1)
        indices, weights = top.indices, top.values
        dy = torch.randn(T, H, generator=gen)
        minimum = mean_over_ranks(minimum_bytes(indices, local, me, pg.ep, H))

        def naive_step():
            out, y_partial, xs, gather = naive_moe(x, indices, weights, experts, first, pg.ep)
            # backward of the reduce-scatter: gather the output grad, then the gathered-input grad back
            y_partial.backward(gather(dy))
            gx = torch.empty_like(x)
            comm.reduce_scatter_tensor(gx, xs.grad.contiguous(), pg.ep)

        with CommRecorder() as rec:
            naive_step()
        peer_moved = mean_over_ranks(sum(r.wire_bytes for r in rec.records))
        for kind in DISPATCHERS:
            d = make_dispatcher(kind, E, pg.ep)

            def step():
                rows, counts, handle = d.dispatch(x, indices, weights)
                d.combine(experts(rows, counts), handle).backward(dy)

            summary = Summary.of(paired_times(step, naive_step, args.repeats, args.warmup))
            with CommRecorder() as rec:
                step()
            moved = mean_over_ranks(sum(r.wire_bytes for r in rec.records))
            results[f"{kind}-ep{ep}"] = (summary, moved, peer_moved, minimum)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (pairs of steps)")
    parser.add_argument("--warmup", type=int, default=2, help="discarded repeats before them")
    args = parser.parse_args()
    print_commit()
    world = 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), args, queue), nprocs=world, start_method="spawn")
        results = queue.get()
    print(f"tokens/rank={args.tokens} hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k} "
          f"world={world} (fwd+bwd, ours and naive interleaved, {args.repeats} repeats after {args.warmup} warm-up, "
          f"slowest rank)")
    for name, (s, moved, peer_moved, minimum) in results.items():
        print(f"{name:14s} ours {s.ours_s * 1e3:8.1f} ms  naive loop {s.peer_s * 1e3:8.1f} ms  ratio {s.ratio:.2f} "
              f"[{s.ratio_min:.2f}, {s.ratio_max:.2f}]  bytes/rank/step ours {moved / 1e6:.2f} MB  naive "
              f"{peer_moved / 1e6:.2f} MB  minimum {minimum / 1e6:.2f} MB")
    for name, (s, moved, peer_moved, minimum) in results.items():
        print(f"RESULT {name} {s.spread()} bytes_ratio={moved / minimum:.3f} peer_bytes_ratio={peer_moved / minimum:.2f}")


if __name__ == "__main__":
    main()
