"""What every rank runs for `pretrain train`: join the group, train, evaluate, log, checkpoint, leave."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import load_config
from .launch import init_distributed, shutdown
from .preflight import checkpoint_root

FAIL_ENV = "PRETRAIN_FAIL_AT"  # "RANK:STEP": that rank raises before that (1-based) step; for failure tests


class _StopRequests:
    """SIGTERM (pre-emption) asks for a checkpoint and a clean exit at the next step boundary.

    The ranks agree over a group with a short timeout: when the launcher SIGTERMs us because a
    peer died, that agreement fails fast and we exit without trying to save with a dead peer.
    A second SIGTERM terminates at once.
    """

    def __init__(self, timeout_s: float) -> None:
        self.requested = False
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=min(timeout_s, 30.0)))
        self.previous = None
        try:
            self.previous = signal.signal(signal.SIGTERM, self._on_signal)
        except ValueError:  # not the main thread: no handler, no pre-emption checkpoint
            pass

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.requested = True

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _injected_failure(rank: int, step: int) -> None:
    spec = os.environ.get(FAIL_ENV, "")
    if spec and spec == f"{rank}:{step + 1}":
        raise RuntimeError(f"injected failure ({FAIL_ENV}={spec}) on rank {rank} before step {step + 1}")


def run_rank(config: str | None, overrides: list[str], device: str | None = None, force: bool = False) -> dict:
    """Train per the config on this rank; rank 0 logs. Returns first/last loss and timings.

    ``device`` (the CLI's --device) overrides [train].device. ``force``: start a new run in a checkpoint directory holding another run's checkpoints."""
    from .checkpoint import CheckpointSaver, latest_checkpoint
    from .checkpoint.retention import start_run
    from .data import load_dataset
    from .flops import training_flops_per_step
    from .metrics import MetricsLogger
    from .peak import matmul_dtype, peak_flops
    from .train_loop import Trainer

    cfg = load_config(config, overrides)
    rank, world, _, dev = init_distributed(cfg.train.timeout_s, device or cfg.train.device)
    stops = None
    try:
        dataset = load_dataset(cfg.data, cfg.model.vocab_size)
        trainer = Trainer(cfg, dataset=dataset, device=dev)
        t, ck = cfg.train, cfg.checkpoint
        root = checkpoint_root(cfg)
        start_step, note = 0, ""
        latest = latest_checkpoint(root) if ck.resume else None
        if latest is not None:
            start_step = trainer.load_checkpoint(latest)
            note = f"; resumed from {latest} at step {start_step}"
        elif ck.init_from:
            trainer.load_checkpoint(ck.init_from, model_only=True)
            note = f"; weights from {ck.init_from}"
        stops = _StopRequests(t.timeout_s)
        saver = CheckpointSaver(ck.async_save, t.timeout_s)  # async: one save in flight, published later
        last_step = t.stop_at or t.steps
        logger = None
        if rank == 0:
            run_id = start_run(root, resuming=ck.resume, force=force)  # refuses another run's directory
            logger = MetricsLogger(
                cfg.log.dir, total_steps=t.steps, devices=world, device=dev, every=cfg.log.every,
                flops_per_step=training_flops_per_step(cfg.model, t.seq_len, t.global_batch),
                peak_flops_per_device=peak_flops(dev, matmul_dtype(trainer.autocast, cfg.train.fp8), cfg.log.peak_tflops),
                tokens_per_step=t.global_batch * t.seq_len, progress=cfg.log.progress, tensorboard=cfg.log.tensorboard,
                start_step=start_step, run_id=run_id,
            )
            logger.message(f"pretrain: {world} ranks: tp={trainer.layout.tp} "
                           f"cp={trainer.layout.cp} pp={trainer.layout.pp} dp={trainer.layout.dp} ep={trainer.layout.ep}, "
                           f"zero={cfg.parallel.zero}; data {dataset.source} (unigram entropy "
                           f"{dataset.unigram_entropy():.3f} nats){note}")
            logger.message(trainer.placement.message)
            if dev.type == "cuda":
                logger.message(f"kernels: {trainer.kernels.describe()}")
        first = last = None
        saved_at = start_step if latest is not None else -1
        done = start_step
        start = time.time()
        for step in range(start_step, last_step):
            t0 = time.time()
            _injected_failure(rank, step)
            result = trainer.train_step(step)
            done = step + 1
            if result.skipped and logger is not None:
                logger.message(f"step {step + 1}: loss is {result.loss}; update skipped ([train].nan_policy=skip)")
            first = result.loss if first is None else first
            last = result.loss
            if logger is not None:
                logger.log(step + 1, result.loss, step_time=time.time() - t0, lr=result.lr, grad_norm=result.grad_norm,
                           **result.moe)
            if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == last_step):
                eval_loss = trainer.evaluate(t.eval_batches)
                if logger is not None:
                    logger.log_eval(step + 1, eval_loss)
            preempted = stops.agreed()
            if (ck.every and done % ck.every == 0) or preempted:
                path = saver.save(trainer, root, done, ck.keep)
                saved_at = done
                if logger is not None:
                    logger.message(f"checkpoint {path}" + (" (writing in the background)" if saver.background else ""))
            if preempted:
                saver.finish()  # published before we exit
                if logger is not None:
                    logger.message(f"SIGTERM: stopped after step {done}, checkpoint written")
                break
        if saved_at != done:  # always a final checkpoint: `convert --to-hf` and resume work after any run
            path = saver.save(trainer, root, done, ck.keep)
            if logger is not None:
                logger.message(f"checkpoint {path}")
        finished = saver.finish()  # the last background save, published once every rank has written it
        if finished is not None and logger is not None:
            logger.message(f"checkpoint {finished} complete")
        if logger is not None:
            if first is not None:
                logger.message(f"done: {done - start_step} steps in {time.time() - start:.1f} s, "
                               f"loss {first:.4f} -> {last:.4f}")
            logger.close()
        dist.barrier()  # only on success: a failed rank must not wait here for peers stuck in a step's collective
        return {"rank": rank, "first_loss": first, "last_loss": last, "seconds": time.time() - start, "steps": done}
    finally:
        if stops is not None:
            stops.close()
        shutdown()
