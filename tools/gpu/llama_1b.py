"""A ~1B Llama trained by `pretrain` on one GPU, the same model in plain PyTorch, and torchtitan's on
the same shape, in one process, one after the other.

par: the trainer (bf16 autocast, fp32 master weights and AdamW in par-zero's buckets, fused AdamW,
flash-attn or SDPA attention). Baseline: tests/plain_llama.py's ``PlainLlama`` (nn.Linear,
nn.RMSNorm, torch SDPA, the same initial weights) under the same autocast, ``torch.optim.AdamW(fused=True)``, torch's
clipping, on the very same batches (``--compile`` compiles it). torchtitan (where it imports; else
one line says why and the ratio is n/a): tools/bench/bench_trainer.py's ``TitanStep`` on one device,
its Llama3Model at this shape (untied, SDPA causal attention), its single-device mixed precision
(torch.autocast bf16), the same micro-batches accumulated, its clipping and the AdamW its optimizer
container builds (fused), on random tokens. Steps after ``--warmup`` are timed (CUDA-synchronized);
the medians give one line to paste into RESULTS.md (one GPU: tokens/s is per GPU):

    RESULT gpu-1b tokens_per_s=<par> mfu=<par, against the GPU's bf16 (or fp8) peak> step_time_par_over_baseline=<par step / baseline step: below 1, par is faster> host_syncs_per_step=<the median step's, torch.cuda.set_sync_debug_mode> peak_mem_gb=<par's torch.cuda.max_memory_allocated> baseline_peak_mem_gb= torchtitan_tokens_per_s= step_time_par_over_torchtitan= torchtitan_peak_mem_gb=

    python tools/gpu/llama_1b.py                       # 16 layers, hidden 2048, seq 4096, 50 steps
    python tools/gpu/llama_1b.py --label te --set model.backend=te --no-baseline
    python tools/gpu/llama_1b.py --device cpu --tiny   # the same code path on the CPU, tiny model (a check)
    python tools/gpu/llama_1b.py --no-torchtitan       # without the torchtitan race
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

LLAMA_1B = ["model.layers=16", "model.hidden=2048", "model.heads=32", "model.kv_heads=8", "model.ffn_hidden=8192",
            "model.vocab_size=32000", "model.rope_theta=500000", "train.seq_len=4096", "train.global_batch=8",
            "train.micro_batch=2", "train.lr=3e-4", "train.min_lr=3e-5"]  # the tiny model's 3e-3 is too hot at width 2048
TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=128",
        "train.seq_len=64", "train.global_batch=4", "train.micro_batch=2"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, steps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each step after the first ``warmup`` ones."""
    times = []
    for s in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step(s)
        sync(device)
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def counted_syncs(device: torch.device):
    """Counts the host syncs torch's sync debug mode reports inside (CUDA only: [count])."""
    count = [0]
    if device.type != "cuda":
        yield count
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode("default")
    count[0] = sum("synchroniz" in str(w.message) for w in caught)


def run_par(cfg, device, warmup: int):
    from pretrain.data import load_dataset
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(cfg, dataset=load_dataset(cfg.data, cfg.model.vocab_size), device=device)
    print(f"par: kernels {trainer.kernels.describe()}", flush=True)
    results, syncs = [], []

    def step(s):  # the loss is read after the run: a read per step would be a sync of this script's
        with counted_syncs(device) as count:
            results.append(trainer.train_step(s))
        syncs.append(count)

    reset_peak(device)
    times = timed(step, cfg.train.steps, warmup, device)
    peak_gb = peak_memory_gb(device)
    print(f"par: loss {results[0].loss:.4f} -> {results[-1].loss:.4f}, peak memory {fmt_gb(peak_gb)} GB; host syncs "
          f"per step (torch.cuda.set_sync_debug_mode) {[c[0] for c in syncs]}", flush=True)
    return (times, trainer.sampler, trainer.autocast, trainer.kernels, statistics.median(c[0] for c in syncs[warmup:]),
            peak_gb)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    """GB torch allocated at most on ``device`` since :func:`reset_peak` (None off CUDA: not measured)."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def fmt_gb(gb: float | None) -> str:
    return "n/a" if gb is None else f"{gb:.1f}"


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_torchtitan(cfg, device, bf16: bool, warmup: int):
    """torchtitan's step on the same shape (tools/bench/bench_trainer.py's TitanStep on one device): (its
    step times, its peak GB), or (None, why it cannot run here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import torchtitan.models.llama3  # noqa: F401 -- a bare machine may lack it or its dependencies
        from bench_trainer import TitanStep
    except Exception as e:  # noqa: BLE001 -- reported in one line, the rest of the check goes on
        return None, f"{type(e).__name__}: {e}"
    m, t = cfg.model, cfg.train
    args = types.SimpleNamespace(hidden=m.hidden, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                                 ffn=m.ffn_hidden, vocab=m.vocab_size, seq=t.seq_len, batch=t.global_batch,
                                 rope_theta=m.rope_theta)
    step = TitanStep(args, "single", cfg, device=device, bf16=bf16, micro=t.micro_batch)
    fused = all(g.get("fused") for o in step.optimizer for g in o.param_groups)
    reset_peak(device)
    times = timed(lambda s: step(), t.steps, warmup, device)
    peak_gb = peak_memory_gb(device)
    print(f"torchtitan: loss {float(step.losses[0]):.4f} -> {float(step.losses[-1]):.4f} (random tokens), peak memory "
          f"{fmt_gb(peak_gb)} GB, AdamW fused={fused}, autocast bf16={step.autocast}", flush=True)
    del step
    return times, peak_gb


def run_baseline(cfg, sampler, device, bf16: bool, compile_model: bool, warmup: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the plain model lives with the tests
    from plain_llama import PlainLlama

    from pretrain.model.initial_state import init_full_state
    from pretrain.training.schedule_lr import lr_at

    t = cfg.train
    with torch.device("meta"):  # no init of nn's own on the host (~1.2B values): the weights are par's initial ones
        model = PlainLlama(cfg.model)
    model.to_empty(device=device).load_state_dict(dict(init_full_state(cfg.model, t.seed)))
    params = list(dict.fromkeys(model.parameters()))
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                            fused=device.type == "cuda")
    forward = torch.compile(model) if compile_model else model
    losses = []

    def step(s):
        batch = sampler.train_batch(s)
        n, total = batch.tokens.shape[0], 0.0
        for m in range(n):
            x, y = batch.inputs[m].t().to(device), batch.labels[m].t().to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits, _ = forward(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            (loss / n).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(s, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, steps=t.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total) / n)

    reset_peak(device)
    times = timed(step, t.steps, warmup, device)
    peak_gb = peak_memory_gb(device)
    print(f"baseline: loss {losses[0]:.4f} -> {losses[-1]:.4f}, peak memory {fmt_gb(peak_gb)} GB", flush=True)
    return times, peak_gb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a tiny model (for checking this script on the CPU)")
    p.add_argument("--label", default="gpu-1b")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra --set for the par run")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the baseline")
    p.add_argument("--no-torchtitan", action="store_true", help="no torchtitan race")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"RESULT {args.label} skipped: no CUDA device")
        return 0
    warmup = min(args.warmup, args.steps - 1)

    from pretrain.config import load_config
    from pretrain.sizing.flops import training_flops_per_step
    from pretrain.runtime.launch import init_distributed, shutdown
    from pretrain.observe.peak import matmul_dtype, peak_flops

    warmup_steps = max(1, min(5, args.steps // 10))
    common = (TINY if args.tiny else LLAMA_1B) + [f"train.steps={args.steps}", f"train.warmup_steps={warmup_steps}",
                                                   "train.eval_every=0", "log.progress=false", "train.nproc=1"]
    cfg = load_config(None, common + [f"train.device={args.device}"] + args.overrides)
    _, _, _, device = init_distributed(cfg.train.collective_timeout_s, args.device)
    base_times = base_peak = titan_times = titan_peak = None
    try:
        par_times, sampler, bf16, kernels, syncs, par_peak = run_par(cfg, device, warmup)
        free(device)
        if not args.no_baseline:
            base_times, base_peak = run_baseline(cfg, sampler, device, bf16, args.compile, warmup)
            free(device)
        if not args.no_torchtitan:
            titan_times, titan_peak = run_torchtitan(cfg, device, bf16, warmup)
            if titan_times is None:
                print(f"torchtitan: not raced, it does not import on {sys.executable}: {titan_peak}", flush=True)
    finally:
        shutdown()
    par_s = statistics.median(par_times)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    peak = peak_flops(device, matmul_dtype(bf16, kernels.fp8))
    mfu = training_flops_per_step(cfg.model, cfg.train.seq_len, cfg.train.global_batch) / par_s / peak if peak else None
    spread = f"{min(par_times):.3f}..{max(par_times):.3f}"
    line = f"RESULT {args.label} tokens_per_s={tokens / par_s:.0f} mfu={'n/a' if mfu is None else f'{mfu:.3f}'}"
    if base_times:
        base_s = statistics.median(base_times)
        line += f" step_time_par_over_baseline={par_s / base_s:.3f}"
        spread += f" s/step; baseline median {base_s:.3f} s ({min(base_times):.3f}..{max(base_times):.3f})"
    line += f" host_syncs_per_step={syncs:g}"  # torch's sync debug mode, inside the training step (CUDA; 0 on the CPU)
    line += f" peak_mem_gb={fmt_gb(par_peak)}"  # torch.cuda.max_memory_allocated over par's steps (n/a on the CPU)
    if base_times:
        line += f" baseline_peak_mem_gb={fmt_gb(base_peak)}"
    if titan_times:
        titan_s = statistics.median(titan_times)
        line += (f" torchtitan_tokens_per_s={tokens / titan_s:.0f} step_time_par_over_torchtitan={par_s / titan_s:.3f}"
                 f" torchtitan_peak_mem_gb={fmt_gb(titan_peak)}")
        spread += f"; torchtitan median {titan_s:.3f} s ({min(titan_times):.3f}..{max(titan_times):.3f})"
    elif not args.no_torchtitan:
        line += " step_time_par_over_torchtitan=n/a"
    print(f"par median {par_s:.3f} s/step ({spread})")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
