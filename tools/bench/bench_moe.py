"""Benchmark par-moe's dispatch + grouped experts + combine against a naive per-expert loop.

CPU, gloo, 4 ranks; ep = 2 (expert DP 2) and ep = 4; both dispatchers. The same fixed routing
(top-k of a mildly skewed random router) and the same expert weights on both sides; forward +
backward per step, median over iterations of the slowest rank. The naive peer is what one writes
first: all-gather the EP group's tokens with plain torch.distributed, loop over the local experts
with a boolean mask each, weighted-add, reduce-scatter.

Bytes are ours over one forward (dispatch + combine), per rank: for the all-to-all the rows that
leave the rank (from its split sizes) plus the counts exchange; for the all-gather dispatcher
(n-1)/n of each op's bytes counted with CommRecorder. Compared with the minimum tokens x hidden x 4 B x (1 - 1/ep)
each way (every token leaving its rank once and coming back once; top-k sends a token once per
routed expert, so the all-to-all's floor is about k times that).

    uv run python tools/bench/bench_moe.py [--tokens 1024 --hidden 256 --ffn 256 --experts 16 --top-k 2 --iters 5]

Ends with ``RESULT <dispatcher>-ep<N> ratio=<ours/naive time> bytes_ratio=<moved/minimum>``.
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
import torch.nn.functional as F

DISPATCHERS = ("alltoall", "allgather")


def _time(step, iters: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(statistics.median(times))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def naive_moe(x, indices, weights, experts, first, ep_group):
    """All-gather tokens, loop over local experts with a mask each, reduce-scatter."""
    ep = dist.get_world_size(ep_group)
    gathered = [torch.empty_like(x) for _ in range(ep)]
    dist.all_gather(gathered, x.detach(), group=ep_group)
    xs = torch.cat(gathered).requires_grad_(x.requires_grad)
    idx = [torch.empty_like(indices) for _ in range(ep)]
    dist.all_gather(idx, indices, group=ep_group)
    idx = torch.cat(idx)
    w = [torch.empty_like(weights) for _ in range(ep)]
    dist.all_gather(w, weights.detach(), group=ep_group)
    w = torch.cat(w)
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
    dist.reduce_scatter_tensor(out, y.detach().contiguous(), group=ep_group)
    return out, y, xs


def _worker(rank, world, init_file, args, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from par_groups import CommRecorder, RankGrid, create_groups
    from par_moe import GroupedSwiGLU, make_dispatcher

    T, H, Fh, E, K = args.tokens, args.hidden, args.ffn, args.experts, args.top_k
    results = {}
    for ep in (2, 4):
        pg = create_groups(RankGrid(world, ep=ep))
        local, first = E // ep, pg.rank_in("ep") * (E // ep)
        torch.manual_seed(1234 + first)  # experts depend on the expert id only
        experts = GroupedSwiGLU(local, H, Fh)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=gen).requires_grad_()
        skew = torch.linspace(0, 1, E)  # mildly unbalanced load, as real routers are
        logits = torch.randn(T, E, generator=gen) + skew
        top = logits.softmax(-1).topk(K, dim=-1)
        indices, weights = top.indices, top.values
        dy = torch.randn(T, H, generator=gen)

        def naive_step():
            out, y_partial, xs = naive_moe(x, indices, weights, experts, first, pg.ep)
            # backward of the reduce-scatter: gather the output grad, then the gathered-input grad back
            grads = [torch.empty_like(dy) for _ in range(ep)]
            dist.all_gather(grads, dy, group=pg.ep)
            y_partial.backward(torch.cat(grads))
            gx = torch.empty_like(x)
            dist.reduce_scatter_tensor(gx, xs.grad.contiguous(), group=pg.ep)

        naive_s = _time(naive_step, args.iters)
        for kind in DISPATCHERS:
            d = make_dispatcher(kind, E, pg.ep)

            def forward():
                rows, counts, handle = d.dispatch(x, indices, weights)
                return d.combine(experts(rows, counts), handle), handle

            def step():
                forward()[0].backward(dy)

            ours_s = _time(step, args.iters)
            with CommRecorder() as rec, torch.no_grad():
                _, handle = forward()
            if kind == "alltoall":  # exact: rows that leave this rank, out and back, plus the counts exchange
                me = pg.rank_in("ep")
                off_rank = sum(handle.input_splits) - handle.input_splits[me] + sum(handle.output_splits) - handle.output_splits[me]
                moved = off_rank * H * 4 + rec.records[0].wire_bytes  # records[0]: the counts all-to-all
            else:  # all-gather / reduce-scatter: (n-1)/n of each op's bytes is exact
                moved = sum(r.wire_bytes for r in rec.records)
            moved_t = torch.tensor(float(moved))
            dist.all_reduce(moved_t)  # routing is skewed, so ranks differ: report the mean over ranks
            moved = moved_t.item() / world
            minimum = T * H * 4 * (1 - 1 / ep) * 2
            results[f"{kind}-ep{ep}"] = (ours_s, naive_s, moved, minimum)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    world = 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), args, queue), nprocs=world, start_method="spawn")
        results = queue.get()
    print(f"tokens/rank={args.tokens} hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k} "
          f"world={world} (fwd+bwd, median of {args.iters}, slowest rank)")
    for name, (ours, naive, moved, minimum) in results.items():
        print(f"{name:14s} ours {ours * 1e3:8.1f} ms  naive loop {naive * 1e3:8.1f} ms  ratio {ours / naive:.2f}  "
              f"fwd bytes/rank (mean) {moved / 1e6:.2f} MB  minimum {minimum / 1e6:.2f} MB")
    for name, (ours, naive, moved, minimum) in results.items():
        print(f"RESULT {name} ratio={ours / naive:.2f} bytes_ratio={moved / minimum:.2f}")


if __name__ == "__main__":
    main()
