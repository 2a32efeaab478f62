"""Benchmark: par-tp transformer block vs torch DTensor ``parallelize_module``, CPU gloo.

Same block (LayerNorm, GQA attention, LayerNorm, SwiGLU; sequence-first [S, B, H]) and the same
full weights on both sides; one step is forward + backward (+ the replicated-grad all-reduce SP
needs on our side). The peer is planned as torchtitan plans a block: with sequence parallelism
the norms are ``SequenceParallel`` and the attention / MLP inputs ``PrepareModuleInput(Shard ->
Replicate, use_local_output=False)``, so the all-gather's backward is a reduce-scatter, as ours;
without it the inputs stay Replicate DTensors, so q/k/v's (and gate/up's) partial input grads
are summed before one all-reduce, as ours.

Timing (``paired_timing``): ours and the peer alternate step by step in the same processes,
warm-up discarded, the slowest rank's time; ratio = median of per-repeat ratios, with min/max.
Bytes per rank per step (``wire_bytes``, ring algorithms): ours from ``par_groups.CommRecorder``,
the peer's from its dispatched collectives (``torch_comm.TorchCommBytes``, a CommDebugMode).

    uv run python tools/bench/bench_tp.py [--repeats 15]

Ends with ``RESULT tp<N>[-sp] ratio= ratio_min= ratio_max= repeats= bytes=<ours> peer_bytes=``.
"""

from __future__ import annotations

import argparse

from commit import print_commit
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

S, B, H, HEADS, KV_HEADS, FFN = 256, 4, 256, 8, 4, 768


class PeerAttention(nn.Module):
    def __init__(self):
        super().__init__()
        from par_tp import causal_attention

        self.core, self.d = causal_attention, H // HEADS
        self.wq = nn.Linear(H, HEADS * self.d, bias=False)
        self.wk = nn.Linear(H, KV_HEADS * self.d, bias=False)
        self.wv = nn.Linear(H, KV_HEADS * self.d, bias=False)
        self.wo = nn.Linear(HEADS * self.d, H, bias=False)

    def forward(self, x):
        s, b = x.shape[:2]
        q, k, v = (w(x).view(s, b, -1, self.d) for w in (self.wq, self.wk, self.wv))  # local heads under TP
        return self.wo(self.core(q, k, v).reshape(s, b, -1))


class PeerMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN, bias=False), nn.Linear(FFN, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PeerBlock(nn.Module):
    """The plain single-device block; DTensor's parallelize_module shards it."""

    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(H), PeerAttention(), nn.LayerNorm(H), PeerMLP()

    def forward(self, x):
        h = x + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))


def build_peer(full, sp, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    blk = PeerBlock()
    with torch.no_grad():
        for n in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"):
            blk.get_parameter(n).copy_(full[n])
        for n in ("wq", "wk", "wv", "wo"):
            getattr(blk.attn, n).weight.copy_(full[n])
        for n in ("gate", "up", "down"):
            getattr(blk.mlp, n).weight.copy_(full[f"w_{n}"])
    out_layout = Shard(0) if sp else Replicate()
    plan = {f"attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
    plan.update({"attn.wo": RowwiseParallel(output_layouts=out_layout), "mlp.gate": ColwiseParallel(),
                 "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=out_layout)})
    if sp:
        # torchtitan's plan: DTensors flow from the norm into the projections (use_local_output=False)
        to_full = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_output=False)
        plan.update({"norm1": SequenceParallel(sequence_dim=0), "norm2": SequenceParallel(sequence_dim=0),
                     "attn": to_full, "mlp": to_full})
    else:  # one DTensor input per sub-block: its projections' partial input grads meet in one all-reduce
        shared = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False)
        plan.update({"attn": shared, "mlp": shared})
    return parallelize_module(blk, mesh, plan)


def full_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    d = H // HEADS
    return {"norm1.weight": 1 + r(H), "norm1.bias": r(H), "norm2.weight": 1 + r(H), "norm2.bias": r(H),
            "wq": r(HEADS * d, H), "wk": r(KV_HEADS * d, H), "wv": r(KV_HEADS * d, H), "wo": r(H, HEADS * d),
            "w_gate": r(FFN, H), "w_up": r(FFN, H), "w_down": r(H, FFN)}


def bench_rank(sp: bool, repeats: int, warmup: int):
    from paired_timing import Summary, paired_times
    from torch.distributed.device_mesh import init_device_mesh
    from torch_comm import TorchCommBytes

    from par_groups import CommRecorder
    from par_tp.testing import TPTransformerBlock, sum_partial_grads_of_

    torch.manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (world,))
    full = full_weights()
    ours = TPTransformerBlock(H, HEADS, KV_HEADS, FFN, group, sequence_parallel=sp).load_full_(full)
    peer = build_peer(full, sp, mesh)
    x_full = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    x = x_full.chunk(world, 0)[rank].contiguous() if sp else x_full

    def step_ours():
        ours.zero_grad(set_to_none=True)
        ours(x).sum().backward()
        sum_partial_grads_of_(ours)

    def step_peer():
        peer.zero_grad(set_to_none=True)
        peer(x).sum().backward()

    with torch.no_grad():
        diff = (ours(x) - peer(x)).abs().max().item()
    with CommRecorder() as rec:
        step_ours()
    with TorchCommBytes() as peer_comm:
        step_peer()
    summary = Summary.of(paired_times(step_ours, step_peer, repeats, warmup))
    return {
        "summary": summary, "wire_bytes": sum(r.wire_bytes for r in rec.records), "peer_wire_bytes": peer_comm.wire_bytes(),
        "ours_ops": rec.ops(), "peer_ops": peer_comm.ops(), "max_abs_diff": diff,
    }


def main():
    from par_groups.testing import RankPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15, help="timed repeats (pairs of steps)")
    ap.add_argument("--warmup", type=int, default=3, help="discarded repeats before them")
    args = ap.parse_args()
    print_commit()
    print(f"block: S={S} B={B} H={H} heads={HEADS} kv_heads={KV_HEADS} ffn={FFN}, fp32, CPU gloo, fwd+bwd, "
          f"{args.repeats} paired repeats after {args.warmup} warm-up (slowest rank)")
    results = []
    for world in (2, 4):
        pool = RankPool(world)
        try:
            for sp in (False, True):
                r = pool.run(bench_rank, sp, args.repeats, args.warmup, timeout=600)[0]
                name, s = f"tp{world}" + ("-sp" if sp else ""), r["summary"]
                ops = {op: r["ours_ops"].count(op) for op in dict.fromkeys(r["ours_ops"])}
                print(f"{name:7s} ours {s.ours_s * 1e3:7.2f} ms  peer(DTensor) {s.peer_s * 1e3:7.2f} ms  "
                      f"ratio {s.ratio:.3f} [{s.ratio_min:.3f}, {s.ratio_max:.3f}]  max|diff| {r['max_abs_diff']:.1e}")
                print(f"        ours collectives {ops}, wire bytes/rank {r['wire_bytes']}")
                print(f"        peer collectives {r['peer_ops']}, wire bytes/rank {r['peer_wire_bytes']}")
                results.append((name, r))
        finally:
            pool.close()
    for name, r in results:
        print(f"RESULT {name} {r['summary'].spread()} bytes={r['wire_bytes']} peer_bytes={r['peer_wire_bytes']}")


if __name__ == "__main__":
    main()
