"""Benchmark a Gated DeltaNet layer under context parallelism: cp2 forward + backward against one rank on
the same tokens, and against an all-gather of the full sequence.

CPU, gloo, fp32; Qwen3-Next's linear-attention layer (``pretrain.models.qwen3_next.gdn``), zigzag layout.

- ours: ``cp_comm_type`` p2p, each rank its zigzag half of the sequence: the conv's halo and the state
  pass (``par_cp.state_passing``), one ``[B, H, dk, dv]`` state per boundary, forward and backward.
- one rank: the same layer on the whole sequence (every rank runs it at the same time as the others, so
  both sides share the machine the same way). Perfect scaling would give ratio 1/cp.
- all-gather: each rank all-gathers the layer's input (the full sequence), runs the layer on all of it and
  keeps its own tokens' output; backward reduce-scatters the input's gradient.

Timing (``paired_timing``): ours and the peer alternate step by step in the same processes, warm-up
discarded, the slowest rank's time; ratio = median of per-repeat ratios ours / peer, with min/max and the
median's 95 % CI. Bytes per rank per step (``wire_bytes``, forward + backward) from ``par_groups.CommRecorder``.
Ours is checked against the one-rank output first (max relative error printed).

    nice uv run python tools/bench/bench_gdn_cp.py [--seq 1024 --hidden 256 --repeats 15]

Ends with ``RESULT gdn-cp2-vs-one-rank ratio= ... bytes=`` and ``RESULT gdn-cp2-vs-allgather ratio= ... bytes=``
(bytes: ours; the all-gather's are printed on its line).
"""

from __future__ import annotations

import argparse

import torch
from bench_ranks import run_spawned
from commit import print_commit
from paired_timing import Summary, paired_times


def _model(args):
    from pretrain.config import load_config

    return load_config(None, ["model.attention=qwen3_next", f"model.hidden={args.hidden}",
                              f"model.linear_key_heads={args.key_heads}", f"model.linear_value_heads={args.value_heads}",
                              f"model.linear_key_dim={args.head_dim}", f"model.linear_value_dim={args.head_dim}"]).model


def _layer(model, groups, seq):
    from pretrain.blocks.context import ChunkContext
    from pretrain.models.qwen3_next.gdn import TPGatedDeltaNet

    layer = TPGatedDeltaNet(model, ChunkContext(groups, False, "p2p", seq, "none"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(layer.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return layer


def _step(layer, x, grad, keep=lambda out: out):
    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        keep(layer(x)).backward(grad)

    return step


def _bytes(step) -> int:
    from par_groups import CommRecorder

    with CommRecorder() as rec:
        step()
    return sum(r.wire_bytes for r in rec.records)


def _measure(rank, world, args):
    from par_cp import shard_segments, shard_sequence
    from par_cp.ulysses import gathered_order
    from par_groups import RankGrid, all_gather_along_dim0, create_groups

    torch.set_num_threads(args.threads)
    model = _model(args)
    cp_groups, one = create_groups(RankGrid(world, cp=world)), create_groups(RankGrid(world))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.seq, args.batch, args.hidden, generator=gen)
    grad = torch.randn(args.seq, args.batch, args.hidden, generator=gen)
    mine = shard_sequence(x, rank, world).requires_grad_()
    my_grad = shard_sequence(grad, rank, world)
    ours = _step(_layer(model, cp_groups, args.seq), mine, my_grad)
    full = _layer(model, one, args.seq)
    one_rank = _step(full, x.clone().requires_grad_(), grad)
    order, inverse, _ = gathered_order([shard_segments(args.seq, r, world) for r in range(world)])
    gathered = mine.detach().clone().requires_grad_()
    n = args.seq // world

    def own_tokens(out):  # the full sequence's output, back in rank order, this rank's block
        return out.index_select(0, inverse)[rank * n:(rank + 1) * n]

    class Gathered(torch.nn.Module):
        def forward(self, xl):
            return full(all_gather_along_dim0(xl, cp_groups.cp).index_select(0, order))

    allgather = _step(Gathered(), gathered, my_grad, own_tokens)
    with torch.no_grad():
        ref = shard_sequence(full(x), rank, world)
        err = ((_layer(model, cp_groups, args.seq)(mine) - ref).abs().max() / ref.abs().max()).item()
    results = {"err": err, "bytes": _bytes(ours), "allgather_bytes": _bytes(allgather)}
    results["one"] = Summary.of(paired_times(ours, one_rank, args.repeats, args.warmup))
    results["allgather"] = Summary.of(paired_times(ours, allgather, args.repeats, args.warmup))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--key-heads", type=int, default=4)
    p.add_argument("--value-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15, help="timed repeats (pairs of steps)")
    p.add_argument("--warmup", type=int, default=2, help="discarded repeats before them")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = p.parse_args()
    print_commit()
    r = run_spawned(_measure, args.world, args)
    print(f"GDN layer cp={args.world} p2p, S={args.seq} B={args.batch} hidden={args.hidden} key heads={args.key_heads} "
          f"value heads={args.value_heads} dk=dv={args.head_dim}, fp32, CPU gloo, {args.threads} thread(s) a rank; "
          f"{args.repeats} paired repeats after {args.warmup} warm-up, slowest rank. cp output vs one rank: max rel "
          f"err {r['err']:.1e}")
    for name, s, nbytes in (("one rank, same tokens", r["one"], 0),
                            ("all-gather of the sequence", r["allgather"], r["allgather_bytes"])):
        print(f"{name:>28}: ours {s.ours_s * 1e3:8.1f} ms  peer {s.peer_s * 1e3:8.1f} ms  ratio {s.ratio:.2f} "
              f"[{s.ratio_min:.2f}, {s.ratio_max:.2f}] ci95 {s.ci_low:.2f}-{s.ci_high:.2f}  bytes/rank ours "
              f"{r['bytes']} peer {nbytes}")
    print(f"RESULT gdn-cp{args.world}-vs-one-rank {r['one'].spread()} bytes={r['bytes']}")
    print(f"RESULT gdn-cp{args.world}-vs-allgather {r['allgather'].spread()} bytes={r['bytes']}")


if __name__ == "__main__":
    main()
