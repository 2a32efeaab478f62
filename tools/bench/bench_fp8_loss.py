"""par's FP8 against high precision: the tiny model's training loss curve and final eval loss with
``[train].fp8`` off (fp32 and bf16 autocast) and with each of par's recipes, one rank, the same data,
init and steps.

    uv run python tools/bench/bench_fp8_loss.py [--steps 300] [--recipes tensorwise rowwise blockwise mxfp8]
        [--out tools/bench/results/fp8_loss.md]

Prints the commit, then per run ``RESULT fp8-loss run=<name> eval_loss= rel_to_bf16= final_train_loss=`` and
writes a markdown table with the loss every 25 steps to ``--out``. The issue's bar: each FP8 recipe's
final eval loss within 2 % of the bf16 run's, and different from it (FP8 is applied).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from commit import measured_commit  # noqa: E402

RUNS_OFF = {"fp32": ["train.dtype=fp32"], "bf16": ["train.dtype=bf16"]}


def train(overrides: list[str], steps: int) -> dict:
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config("tiny", [f"train.steps={steps}", "train.eval_every=0", "log.progress=false",
                               f"train.warmup_steps={min(20, steps)}", "train.eval_batches=8"] + overrides)
    trainer = Trainer(cfg)
    losses = [trainer.train_step(step).loss for step in range(steps)]
    return {"losses": losses, "eval_loss": trainer.evaluate(cfg.train.eval_batches)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise", "blockwise", "mxfp8"])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "fp8_loss.md"))
    args = p.parse_args()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29573")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"commit: {measured_commit()}")
    runs = dict(RUNS_OFF) | {f"fp8-{r}": ["train.dtype=bf16", f"train.fp8={r}"] for r in args.recipes}
    results = {}
    for name, overrides in runs.items():  # fp32 and bf16 first: each line as its run ends
        r = results[name] = train(overrides, args.steps)
        bf16 = results["bf16"]["eval_loss"] if "bf16" in results else float("nan")
        print(f"RESULT fp8-loss run={name} eval_loss={r['eval_loss']:.4f} rel_to_bf16={r['eval_loss'] / bf16 - 1:+.4f} "
              f"final_train_loss={r['losses'][-1]:.4f} steps={args.steps}", flush=True)
    bf16 = results["bf16"]["eval_loss"]
    every = [s for s in range(0, args.steps, 25)] + [args.steps - 1]
    lines = [f"# FP8 vs high precision, tiny model, {args.steps} steps, one CPU rank (commit {measured_commit()})", "",
             "| run | eval loss | vs bf16 | " + " | ".join(f"step {s}" for s in every) + " |",
             "|---|---|---|" + "---|" * len(every)]
    for name, r in results.items():
        lines.append(f"| {name} | {r['eval_loss']:.4f} | {r['eval_loss'] / bf16 - 1:+.2%} | "
                     + " | ".join(f"{r['losses'][s]:.4f}" for s in every) + " |")
    lines += ["", "Command: `uv run python tools/bench/bench_fp8_loss.py --steps " + str(args.steps) + "`", "",
              "```json", json.dumps({k: v["eval_loss"] for k, v in results.items()}), "```"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
