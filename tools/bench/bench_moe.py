"""Benchmark par-moe's dispatch + grouped experts + combine against torchtitan's expert-parallel all-to-all.

CPU, gloo, 4 ranks; ep = 2 (expert DP 2) and ep = 4; both our dispatchers; two fixed routings of
a mildly skewed random router: ``topk`` (its top-k) and ``one-per-rank`` (its best expert on each
EP rank, k = ep: no token goes to one rank twice, so both sides move the same bytes). The same experts (our GroupedSwiGLU, the same weights)
on both sides, so the dispatchers are what differs; one step is forward + backward. Before timing,
each pair's forward outputs are asserted equal (rtol = atol = 1e-5).

The peer is torchtitan 0.3.0's ``AllToAllTokenDispatcher`` (models/common/token_dispatcher.py,
bench-only dependency): sort the (token, expert) pairs by expert, exchange the counts, one
all-to-all of those rows, permute to expert-major; combine reverses it and scatter-adds the
weighted rows. megatron-core 0.16.1's ``MoEAlltoAllTokenDispatcher`` (what we would pick first)
does not run here: its constructor makes a ``torch.cuda.Stream()`` and its token-count sync point
runs under ``torch.cuda.stream``, so it needs CUDA. torchtitan's is plain torch (functional
all-to-all) and runs on gloo.

Bytes are not equal by construction: torchtitan sends every (token, expert) pair, so a token with
two experts on one rank goes there twice, where ours sends it once (``peer_bytes_ratio`` vs
``bytes_ratio``, both over the same minimum).

Timing (``paired_timing``): ours and the peer alternate step by step in the same processes,
warm-up repeats discarded, each step's time the slowest rank's; ``ratio`` is the median of the
per-repeat ratios ours / peer, ``ratio_min`` / ``ratio_max`` their spread.

Bytes: every collective of one step (forward + backward) is recorded, ours through
``par_groups.comm``, torchtitan's from the dispatched functional collectives (``torch_comm.py``);
a rank's bytes are what it sends to other ranks (``wire_bytes``: an all-to-all's off-rank split sizes, (n-1)/n of an all-gather or reduce-scatter),
averaged over the ranks. The minimum is the routing's: each token sent once to each other EP
rank holding any of its experts and its result sent back once, forward and again backward
(2 x 2 x rows x hidden x 4 B). ``bytes_ratio`` is ours / that minimum, ``peer_bytes_ratio``
torchtitan's.

    uv run python tools/bench/bench_moe.py [--tokens 256 --hidden 256 --ffn 256 --experts 64 --top-k 8 --repeats 7]

Ends with ``RESULT <dispatcher>-<routing>-ep<N> ratio=<median ours/torchtitan> ratio_min= ratio_max= repeats=
bytes_ratio=<moved/minimum> peer_bytes_ratio=``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from bench_ranks import run_spawned
from commit import print_commit
from paired_timing import Summary, paired_times
from torch_comm import TorchCommBytes

DISPATCHERS = ("alltoall", "allgather")


def ep_mesh_of(ep_group):
    """A torch DeviceMesh whose 'ep' dimension is this rank's EP group (torchtitan wires its dispatcher to it)."""
    from torch.distributed.device_mesh import DeviceMesh

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dist.get_process_group_ranks(ep_group))
    rows = sorted({tuple(ranks) for ranks in everyone})  # one row per EP group
    return DeviceMesh("cpu", torch.tensor(rows), mesh_dim_names=("edp", "ep"))["ep"]


def torchtitan_dispatcher(num_experts: int, top_k: int, ep_group):
    """torchtitan 0.3.0's expert-parallel all-to-all token dispatcher (models/common/token_dispatcher.py)."""
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    # torchtitan's trainer sets this from parallelism.spmd_backend; 'partial_dtensor' is its path that
    # needs no spmd_types mesh context: the functional all-to-all over the EP mesh's group
    set_spmd_backend("partial_dtensor")
    d = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=num_experts, top_k=top_k))
    d.wire_meshes(ep_mesh=ep_mesh_of(ep_group))
    return d


def torchtitan_moe(d, x, indices, weights, experts, num_experts):
    """torchtitan's dispatch (sort by expert, counts exchange, all-to-all, permute), our experts, its combine."""
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts)
    rows, local_counts, meta = d.dispatch(x, weights, indices, counts)
    return d.combine(experts(rows, local_counts), meta, x)


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


def route(logits: torch.Tensor, top_k: int, ep: int, routing: str):
    """(indices, weights) per token: 'topk' the router's top-k; 'one-per-rank' its best expert on
    each EP rank (k = ep, so no token goes to one rank twice and both sides move the same rows)."""
    if routing == "topk":
        top = logits.softmax(-1).topk(top_k, dim=-1)
        return top.indices, top.values
    local = logits.shape[1] // ep
    best = logits.view(logits.shape[0], ep, local).max(-1)
    indices = best.indices + torch.arange(ep) * local
    return indices, best.values.softmax(-1)


def run_case(results, case, args, pg, x, indices, weights, experts, local, me):
    """Time our dispatchers against torchtitan's on one routing; results[f"{dispatcher}-{case}"]."""
    from par_groups import CommRecorder
    from par_moe import make_dispatcher

    E, H = args.experts, args.hidden
    gen = torch.Generator().manual_seed(dist.get_rank() + 100)
    dy = torch.randn(x.shape[0], H, generator=gen)
    minimum = mean_over_ranks(minimum_bytes(indices, local, me, pg.ep, H))
    titan = torchtitan_dispatcher(E, indices.shape[1], pg.ep)

    def peer_step():
        torchtitan_moe(titan, x, indices, weights, experts, E).backward(dy)

    with TorchCommBytes() as peer_comm:
        peer_step()
    peer_moved = mean_over_ranks(peer_comm.wire_bytes())
    for kind in DISPATCHERS:
        d = make_dispatcher(kind, E, pg.ep)

        def step():
            rows, counts, handle = d.dispatch(x, indices, weights)
            d.combine(experts(rows, counts), handle).backward(dy)

        with torch.no_grad():  # the same computation: our output is torchtitan's
            rows, counts, handle = d.dispatch(x, indices, weights)
            ours_y, peer_y = d.combine(experts(rows, counts), handle), torchtitan_moe(titan, x, indices, weights, experts, E)
            torch.testing.assert_close(ours_y, peer_y, rtol=1e-5, atol=1e-5)
        summary = Summary.of(paired_times(step, peer_step, args.repeats, args.warmup))
        with CommRecorder() as rec:
            step()
        moved = mean_over_ranks(sum(r.wire_bytes for r in rec.records))
        results[f"{kind}-{case}"] = (summary, moved, peer_moved, minimum)


def _measure(rank, world, args):
    from par_groups import RankGrid, create_groups
    from par_moe import GroupedSwiGLU

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
        for routing in ("topk", "one-per-rank"):
            indices, weights = route(logits, K, ep, routing)
            run_case(results, f"{routing}-ep{ep}", args, pg, x, indices, weights, experts, local, me)
    return results


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
    results = run_spawned(_measure, world, args)
    print(f"tokens/rank={args.tokens} hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k} "
          f"world={world} (fwd+bwd, ours and torchtitan's all-to-all interleaved, {args.repeats} repeats after {args.warmup} warm-up, "
          f"slowest rank)")
    for name, (s, moved, peer_moved, minimum) in results.items():
        print(f"{name:14s} ours {s.ours_s * 1e3:8.1f} ms  torchtitan {s.peer_s * 1e3:8.1f} ms  ratio {s.ratio:.2f} "
              f"[{s.ratio_min:.2f}, {s.ratio_max:.2f}]  bytes/rank/step ours {moved / 1e6:.2f} MB  torchtitan "
              f"{peer_moved / 1e6:.2f} MB  minimum {minimum / 1e6:.2f} MB")
    for name, (s, moved, peer_moved, minimum) in results.items():
        print(f"RESULT {name} {s.spread()} bytes_ratio={moved / minimum:.3f} peer_bytes_ratio={peer_moved / minimum:.2f}")


if __name__ == "__main__":
    main()
