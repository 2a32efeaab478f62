"""Benchmark expert_balance = "replicate" (par_moe.replicate) against the standard all-to-all dispatch, and
against torchtitan's all-to-all MoE dispatcher, on the same skewed routing.

CPU, gloo, 4 ranks, ep = 4. A fixed routing where every token's top-k (k = 4 of 16 experts) holds
experts 0 .. ``--hot`` - 1, all on EP rank 0: the hottest rank holds about ``--hot`` of every 4
pairs (2.28x the mean for the default ``--hot 2``, 3.07x for ``--hot 3``; asserted >= 2x). The same experts (our GroupedSwiGLU, the same
weights) on every side; one step is dispatch, experts, combine, forward and backward:

* ``balanced``: :class:`par_moe.replicate.ReplicatingDispatcher` with its replica weight fetch
  (every EP rank computes at most ceil(pairs / ep) pairs; the hot experts' gradients return home);
* ``standard``: :class:`par_moe.AllToAllDispatcher` (each rank computes all of its experts' pairs);
* ``torchtitan``: torchtitan 0.3.0's ``AllToAllTokenDispatcher`` (bench_moe.py's wiring: plain torch,
  functional all-to-all, runs on gloo), our experts; no balancing.

Before timing, the three forward outputs are asserted equal (rtol = atol = 1e-5). Timing
(``paired_timing``): balanced and the peer alternate step by step in the same processes, warm-up
repeats discarded, each step's time the slowest rank's; ``ratio`` is the median of the per-repeat
ratios balanced / peer with its spread and 95 % CI.

Balancing moves compute from the hot rank to idle ones: it can only shorten a step where the ranks
run in parallel. With fewer cores than ranks (``os.cpu_count()`` is printed) the ranks share the
cores and the total work, not the hottest rank's, sets the wall time: on 2 cores the best wall
ratio is about (total / 2) / hottest = 2 / 2.28 = 0.88 for ``--hot 2``, 2 / 3.07 = 0.65 for ``--hot 3``. So each step's CPU time is
taken too (``time.process_time``, every thread of the rank; a rank blocked in a gloo wait spends
none): the ``-cpu`` rows compare the busiest rank's, what sets the step when every rank has its
own core, communication waits aside.

    uv run python tools/bench/bench_expert_balance.py [--hot 2 --tokens 1024 --hidden 128 --ffn 256 --repeats 15]

Ends with ``RESULT balanced-vs-<peer>-ep4 ratio= ratio_min= ratio_max= ci95= repeats= hot_over_mean=``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from bench_moe import torchtitan_dispatcher, torchtitan_moe
from bench_ranks import run_spawned
from commit import print_commit
from paired_timing import Summary, paired_times

EP, EXPERTS, TOP_K = 4, 16, 4


def skewed_routing(tokens: int, hot: int, gen: torch.Generator):
    """Every token's top 4: experts 0 .. hot-1 (EP rank 0), then the best of the rest by random logits."""
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    logits[:, :hot] += 100.0
    top = logits.softmax(-1).topk(TOP_K, dim=-1)
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    return top.indices, weights / weights.sum(-1, keepdim=True)


def cpu_timed(step, out: list):
    """``step``, appending its process CPU seconds to ``out`` (one entry per run, in run order)."""
    def run():
        start = time.process_time()
        step()
        out.append(time.process_time() - start)
    return run


def _measure(rank, world, args):
    from par_groups import RankGrid, create_groups
    from par_moe import AllToAllDispatcher, GroupedSwiGLU
    from par_moe.replicate import ReplicatingDispatcher, fetch_replicas

    pg = create_groups(RankGrid(world, ep=EP))
    local, me = EXPERTS // EP, pg.rank_in("ep")
    torch.manual_seed(1234 + me)
    experts = GroupedSwiGLU(local, args.hidden, args.ffn)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, generator=gen)
    indices, weights = skewed_routing(args.tokens, args.hot, gen)
    balanced, standard = ReplicatingDispatcher(EXPERTS, pg.ep, args.max_replicas), AllToAllDispatcher(EXPERTS, pg.ep)
    titan = torchtitan_dispatcher(EXPERTS, TOP_K, pg.ep)

    def balanced_y():
        rows, counts, h = balanced.dispatch(x, indices, weights)
        replicas = fetch_replicas(experts.w_gate, experts.w_up, experts.w_down, h.plan, pg.ep, me)
        return balanced.combine(experts(rows, counts, h.max_count, replicas), h)

    def standard_y():
        rows, counts, h = standard.dispatch(x, indices, weights)
        return standard.combine(experts(rows, counts, h.max_count), h)

    def titan_y():
        return torchtitan_moe(titan, x, indices, weights, experts, EXPERTS)

    with torch.no_grad():  # the same computation on every side
        ours = balanced_y()
        for peer in (standard_y(), titan_y()):
            torch.testing.assert_close(ours, peer, rtol=1e-5, atol=1e-5)
    plan = balanced.last_plan
    results = {"hot_over_mean": plan.max_over_mean(plan.load_before), "after": plan.max_over_mean(plan.load_after),
               "replicas": sum(len(r) for r in plan.replicas)}
    for name, peer in (("standard", standard_y), ("torchtitan", titan_y)):
        ours_cpu, peer_cpu = [], []  # CPU seconds of each run on this rank
        pairs = paired_times(cpu_timed(lambda: balanced_y().backward(dy), ours_cpu),
                             cpu_timed(lambda: peer().backward(dy), peer_cpu), args.repeats, args.warmup)
        results[name] = Summary.of(pairs)
        busiest = torch.tensor([ours_cpu, peer_cpu], dtype=torch.float64).t().contiguous()  # [repeat, side]
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)  # the busiest rank's
        results[f"{name}-cpu"] = Summary.of([tuple(row) for row in busiest[args.warmup:].tolist()])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--max-replicas", type=int, default=2, help="replica slots per rank (the config default)")
    parser.add_argument("--hot", type=int, default=2, choices=(2, 3, 4),
                        help="experts of EP rank 0 in every token's top 4 (the skew)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats (pairs of steps)")
    parser.add_argument("--warmup", type=int, default=3, help="discarded repeats before them")
    args = parser.parse_args()
    print_commit()
    world = 4
    r = run_spawned(_measure, world, args)
    assert r["hot_over_mean"] >= 2.0, f"the skew gives the hottest rank {r['hot_over_mean']:.2f}x the mean, not >= 2x"
    print(f"tokens/rank={args.tokens} hidden={args.hidden} ffn={args.ffn} experts={EXPERTS} top_k={TOP_K} ep={EP} "
          f"world={world} cpus={os.cpu_count()} (fwd+bwd, interleaved, {args.repeats} repeats after {args.warmup} warm-up, "
          f"slowest rank); pairs per EP rank max/mean {r['hot_over_mean']:.2f} standard, {r['after']:.3f} balanced "
          f"({r['replicas']} replicas)")
    names = ("standard", "torchtitan", "standard-cpu", "torchtitan-cpu")
    for name in names:
        s, what = r[name], "busiest rank's CPU" if name.endswith("cpu") else "wall, slowest rank"
        print(f"balanced {s.ours_s * 1e3:8.1f} ms  {name:14s} {s.peer_s * 1e3:8.1f} ms  ratio {s.ratio:.2f} "
              f"[{s.ratio_min:.2f}, {s.ratio_max:.2f}] ci95 [{s.ci_low:.2f}, {s.ci_high:.2f}] ({what})")
    for name in names:
        print(f"RESULT balanced-vs-{name}-ep4 {r[name].spread()} hot_over_mean={r['hot_over_mean']:.2f} cpus={os.cpu_count()}")


if __name__ == "__main__":
    main()
