"""Exposed communication from the collectives' own CUDA events, on one GPU (issue 47).

A tiny model trained by pretrain's Trainer under the run's default timing (``[log].timing``: the
StepTimer and the watch over every collective; NCCL with one rank, so the gradient, grad-norm and
loss all-reduces still run through NCCL on the GPU). Every ``--every``-th step is a log step. Each
step prints the event pairs the watch kept (one per collective on CUDA tensors) and the host syncs
torch's sync debug mode saw inside it; each log step prints the step's parts read from the events
(``time_exposed_comm_s`` among them) and the syncs of that read. Then one line:

    RESULT gpu-comm-events exposed_comm_ms=<each log step's> event_pairs_per_step=<median>
        syncs_outside_log_steps=<total; 0 expected> syncs_per_log_read=<median>

Exit 1 if a step outside the log steps synchronized, or (CUDA) a step kept no event pair. ``--device cpu`` runs the same code on the
CPU (how check.sh's CPU mode checks this script): there the waits are host-timed and no event is made.

    python tools/gpu/comm_events.py [--steps 12] [--every 4] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from llama_1b import TINY, counted_syncs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="a log step every this many steps")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("RESULT gpu-comm-events skipped: no CUDA device")
        return 0

    from par_groups.watch import CommWatch

    from pretrain.config import load_config
    from pretrain.data import load_dataset
    from pretrain.runtime.launch import init_distributed, shutdown
    from pretrain.observe.step_timing import StepTimer
    from pretrain.training.train_loop import Trainer

    cfg = load_config(None, TINY + [f"train.steps={args.steps}", "train.warmup_steps=1", "train.eval_every=0",
                                    "log.progress=false", "train.nproc=1", f"train.device={args.device}"])
    _, _, _, device = init_distributed(cfg.train.collective_timeout_s, args.device)
    outside, log_syncs, pairs, exposed_ms = 0, [], [], []
    try:
        with CommWatch(0) as watch:
            trainer = Trainer(cfg, dataset=load_dataset(cfg.data, cfg.model.vocab_size), device=device,
                              timer=StepTimer(watch, device))
            for step in range(args.steps):
                with counted_syncs(device) as syncs:
                    trainer.train_step(step)
                kept = len(trainer.timer.last[2])  # the step's (op, start, end) events, unread
                pairs.append(kept)
                line = f"step {step + 1}: {kept} event pairs, {syncs[0]} host syncs in the step"
                if (step + 1) % args.every:
                    outside += syncs[0]
                    print(line, flush=True)
                    continue
                with counted_syncs(device) as read:
                    record = trainer.timer.gathered()  # the log step's read
                log_syncs.append(read[0])
                exposed_ms.append(1e3 * record["time_exposed_comm_s"])
                parts = ", ".join(f"{k[5:-2]} {1e3 * record[k]:.3f}" for k in
                                  ("time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_exposed_comm_s"))
                print(f"{line}; log step (ms): {parts}; {read[0]} host syncs in the read", flush=True)
    finally:
        shutdown()
    print(f"RESULT gpu-comm-events exposed_comm_ms={','.join(f'{x:.4f}' for x in exposed_ms)} "
          f"event_pairs_per_step={statistics.median(pairs):g} syncs_outside_log_steps={outside} "
          f"syncs_per_log_read={statistics.median(log_syncs) if log_syncs else 'n/a'}", flush=True)
    problems = [f"{outside} host syncs outside the log steps (0 expected)"] if outside else []
    if device.type == "cuda" and min(pairs) == 0:
        problems.append("a step kept no event pair: its collectives were not timed on the stream")
    for problem in problems:
        print(f"comm_events: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
