"""What every rank runs for `pretrain train`: join the group, train, evaluate, log, leave."""

from __future__ import annotations

import math
import time

import torch.distributed as dist

from .config import load_config
from .launch import init_distributed, shutdown


def run_rank(config: str | None, overrides: list[str], device: str = "auto") -> dict:
    """Train per the config on this rank; rank 0 logs. Returns first/last loss and timings."""
    from .data import load_dataset
    from .flops import training_flops_per_step
    from .metrics import MetricsLogger, peak_flops
    from .train_loop import Trainer

    cfg = load_config(config, overrides)
    rank, world, _, dev = init_distributed(cfg.train.timeout_s, device)
    try:
        dataset = load_dataset(cfg.data, cfg.model.vocab_size)
        trainer = Trainer(cfg, dataset=dataset, device=dev)
        t = cfg.train
        last_step = t.stop_at or t.steps
        logger = None
        if rank == 0:
            logger = MetricsLogger(
                cfg.log.dir, total_steps=t.steps, devices=world, device=dev, every=cfg.log.every,
                flops_per_step=training_flops_per_step(cfg.model, t.seq_len, t.global_batch),
                peak_flops_per_device=peak_flops(dev, "fp32", cfg.log.peak_tflops),
                tokens_per_step=t.global_batch * t.seq_len, progress=cfg.log.progress, tensorboard=cfg.log.tensorboard,
            )
            logger.message(f"pretrain: {world} ranks, layout {trainer.layout.grid().world_size}: tp={trainer.layout.tp} "
                           f"cp={trainer.layout.cp} pp={trainer.layout.pp} dp={trainer.layout.dp} ep={trainer.layout.ep}, "
                           f"zero={cfg.parallel.zero}; data {dataset.source} (unigram entropy "
                           f"{dataset.unigram_entropy():.3f} nats)")
        first = last = None
        start = time.time()
        for step in range(last_step):
            t0 = time.time()
            result = trainer.train_step(step)
            if not math.isfinite(result.loss):
                if t.nan_policy == "stop":
                    raise FloatingPointError(f"loss is {result.loss} at step {step + 1}; stopping ([train].nan_policy=stop)")
            first = result.loss if first is None else first
            last = result.loss
            if logger is not None:
                logger.log(step + 1, result.loss, step_time=time.time() - t0, lr=result.lr, grad_norm=result.grad_norm,
                           **result.moe)
            if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == last_step):
                eval_loss = trainer.evaluate(t.eval_batches)
                if logger is not None:
                    logger.log_eval(step + 1, eval_loss)
        if logger is not None:
            logger.message(f"done: {last_step} steps in {time.time() - start:.1f} s, loss {first:.4f} -> {last:.4f}")
            logger.close()
        return {"rank": rank, "first_loss": first, "last_loss": last, "seconds": time.time() - start}
    finally:
        if dist.is_initialized():
            dist.barrier()
        shutdown()
