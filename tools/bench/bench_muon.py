"""[train].optimizer = "muon" against "adamw": the trainer's step time and its optimizer-state bytes.

    uv run python tools/bench/bench_muon.py [--layouts dp2 tp2 dp2-qkclip] [--repeats 15] [--warmup 2]
        [--hidden 256 --layers 4 --heads 8 --kv-heads 8 --ffn 768 --vocab 2048 --seq 128 --batch 8]
        [--ns-dtype bf16|fp32] [--qk-clip TAU]

Two CPU gloo ranks, fp32, one intra-op thread each. Per layout two ``pretrain.training.train_loop.Trainer``s
of the same shape live in the same two processes, one with Muon (Newton-Schulz in ``--ns-dtype``,
bf16 = torch.optim.Muon's) and one with AdamW, both par-zero's with the trainer's defaults on the
CPU (AdamW: the explicit ops, ``fused_adamw=auto``). A repeat runs one whole training step (data,
forward, backward, clip, optimizer) of each in alternating order after a barrier, the slowest rank's
time counts, the warm-up repeats are dropped (tools/bench/paired_timing.py): ``ratio`` is the median
per-repeat step time Muon / AdamW, its [min, max] and the median's 95 % CI.

Layouts: ``dp2`` (ZeRO-3, ``optim_grads_params``: each Muon matrix all-gathered over dp before
Newton-Schulz), ``tp2`` (TP, each matrix's shards all-gathered over tp), ``dp2-qkclip``
(``--qk-clip``'s cost: Muon with ``[train].muon_qk_clip`` over Muon without, at dp2 ZeRO-3).

Memory: the bytes of the optimizer's state tensors on a rank (``optimizer.state_tensors()``,
distinct storages; the fp32 masters, the same on both sides, apart), the largest over the ranks;
and the bytes that state needs (Muon: one fp32 momentum per element of its matrices, two fp32
moments per element of AdamW's params; AdamW: two moments per element).

Ends with ``RESULT muon layout=<name> ratio= ratio_min= ratio_max= ci95= repeats= muon_ms= adamw_ms=
state_bytes_muon= state_bytes_adamw= state_ratio= needed_bytes_muon= needed_ratio=`` per layout.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_ranks import add_model_arguments, launch_with_load  # noqa: E402
from commit import print_commit  # noqa: E402
from paired_timing import Summary, paired_times  # noqa: E402

LAYOUTS = {  # name: (overrides of both sides, ours extra, peer extra)
    "dp2": (["parallel.zero=optim_grads_params"], ["train.optimizer=muon"], ["train.optimizer=adamw"]),
    "tp2": (["parallel.tp=2"], ["train.optimizer=muon"], ["train.optimizer=adamw"]),
    "dp2-qkclip": (["parallel.zero=optim_grads_params", "train.optimizer=muon"], ["QKCLIP"], []),
}
WORLD = 2


def trainer(args, overrides: list[str], steps: int):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    overrides = [f"train.muon_qk_clip={args.qk_clip}" if o == "QKCLIP" else o for o in overrides]
    return Trainer(load_config(None, [
        f"model.hidden={args.hidden}", f"model.layers={args.layers}", f"model.heads={args.heads}",
        f"model.kv_heads={args.kv_heads}", f"model.ffn_hidden={args.ffn}", f"model.vocab_size={args.vocab}",
        "model.tie_embeddings=false", f"train.seq_len={args.seq}", f"train.global_batch={args.batch}",
        f"train.steps={steps}", "train.warmup_steps=2", "train.eval_every=0", "train.dtype=fp32",
        "log.progress=false", f"train.muon_ns_dtype={args.ns_dtype}", *overrides]))


def state_bytes(t) -> tuple[int, int]:
    """(bytes of the optimizer's state tensors, bytes its math needs) on this rank."""
    from par_zero.muon import DistributedMuon

    opt = t.model.dp.optimizer
    seen, held = set(), 0
    for x in opt.state_tensors():
        st = x.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            held += st.nbytes()
    if isinstance(opt, DistributedMuon):
        count = lambda runs: sum(hi - lo for rs in runs.values() for lo, hi in rs)  # noqa: E731
        return held, 4 * count(opt.muon_runs) + 8 * count(opt.adam_runs)
    return held, 8 * sum(b.opt_hi - b.opt_lo for b in opt.buckets)


def measure(args):
    import torch
    import torch.distributed as dist

    out = {}
    for layout in args.layouts:
        common, mine, peer = LAYOUTS[layout]
        steps = 2 * (args.warmup + args.repeats) + 4
        ours, theirs = trainer(args, common + mine, steps), trainer(args, common + peer, steps)
        losses, step_ours, step_theirs = ([], []), iter(range(steps)), iter(range(steps))
        pairs = paired_times(lambda: losses[0].append(ours.train_step(next(step_ours)).loss),
                             lambda: losses[1].append(theirs.train_step(next(step_theirs)).loss),
                             repeats=args.repeats, warmup=args.warmup)
        mem = torch.tensor([*state_bytes(ours), *state_bytes(theirs)], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        out[layout] = {"pairs": pairs, "losses": losses, "mem": [int(x) for x in mem.tolist()]}
        del ours, theirs
        dist.barrier()
    return out


def report(args, results: dict) -> None:
    print(f"shape: hidden {args.hidden}, layers {args.layers}, heads {args.heads}/{args.kv_heads} kv, ffn {args.ffn}, "
          f"vocab {args.vocab}, seq {args.seq}, global batch {args.batch}, fp32, Newton-Schulz in {args.ns_dtype}, "
          f"{WORLD} CPU gloo ranks, {args.threads} intra-op thread(s) each")
    for layout, r in results.items():
        summary = Summary.of(r["pairs"])
        held_m, need_m, held_a, need_a = r["mem"]
        fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        peer = "muon" if layout.endswith("qkclip") else "adamw"
        print(f"layout {layout}: losses {'muon+qkclip' if peer == 'muon' else 'muon'} {fmt(r['losses'][0])}")
        print(f"layout {layout}: losses {peer} {fmt(r['losses'][1])}")
        print(f"RESULT muon layout={layout} {summary.spread(3)} "
              f"ours_ms={1e3 * summary.ours_s:.1f} {peer}_ms={1e3 * summary.peer_s:.1f} "
              f"state_bytes_ours={held_m} state_bytes_{peer}={held_a} state_ratio={held_m / held_a:.3f} "
              f"needed_bytes_ours={need_m} needed_ratio={need_m / need_a:.3f} metric=step_time_ratio_lower_is_better")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=["dp2", "tp2"], choices=list(LAYOUTS))
    add_model_arguments(p, layers=4, heads=8, repeats=15)
    p.add_argument("--ns-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--qk-clip", type=float, default=0.05, help="tau of dp2-qkclip (low: the clip runs every step)")
    args = p.parse_args()
    print_commit()
    report(args, launch_with_load(measure, args, WORLD))


if __name__ == "__main__":
    main()
