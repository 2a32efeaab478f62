"""What every rank runs for `pretrain train`: join the group, train, evaluate, log, checkpoint, leave."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack, nullcontext

from par_groups import comm
from par_groups.watch import CommWatch

# imported here, not in run_rank: the launcher's forkserver preloads this module once for all ranks
from .checkpoint import CheckpointSaver, resolve_checkpoint
from .checkpoint.resume import resume_latest, unverified_note
from .checkpoint.retention import start_run
from .config import load_config
from .data import load_dataset
from .sizing.flops import training_flops_per_step
from .hang import flight_recorder, nccl_flight_env
from .launch import device_type, init_distributed, shutdown
from .metrics import MetricsLogger
from .peak import matmul_dtype, peak_flops
from .preempt import StopRequests
from .preflight import checkpoint_root
from .profile_window import ProfileWindow
from .step_timing import StepTimer
from .train_loop import Trainer


def run_rank(config: str | None, overrides: list[str], device: str | None = None, force: bool = False) -> dict:
    """Train per the config on this rank; rank 0 logs. Returns first/last loss and timings.

    ``device`` (the CLI's --device) overrides [train].device. ``force``: start a new run in a checkpoint directory holding another run's checkpoints."""
    cfg = load_config(config, overrides)
    if device_type(device or cfg.train.device) == "cuda":
        os.environ.update(nccl_flight_env(cfg.log.dir))  # NCCL's flight recorder too (read at group creation)
    rank, world, _, dev = init_distributed(cfg.train.timeout_s, device or cfg.train.device)
    stops = StopRequests(cfg.train.timeout_s)  # from here a signal means: save after the next step
    watching = ExitStack()
    try:
        watch = watching.enter_context(_watch(cfg, rank))  # over every collective of the run
        dataset = load_dataset(cfg.data, cfg.model.vocab_size)
        trainer = Trainer(cfg, dataset=dataset, device=dev)
        if watch is not None:
            watch.name_groups(trainer.groups.ranks)  # "tp", "dp", "pp" ... in records and traces
        if cfg.log.timing:
            trainer.timer = StepTimer(watch, dev)
        profiler = ProfileWindow(cfg, rank, dev, watch)
        t, ck = cfg.train, cfg.checkpoint
        root = checkpoint_root(cfg)
        start_step, note = 0, ""
        latest, start_step, why = resume_latest(trainer, root, ck.fallback) if ck.resume else (None, 0, "")
        if latest is not None:
            note = f"; resumed from {latest} at step {start_step}{why}"
        elif ck.init_from:
            trainer.load_checkpoint(ck.init_from, model_only=True)
            note = f"; weights from {ck.init_from}" + unverified_note(resolve_checkpoint(ck.init_from))
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
                start_step=start_step, run_id=run_id, wandb=_wandb_init(cfg, trainer.layout),
            )
            logger.message(f"pretrain: {world} ranks: tp={trainer.layout.tp} "
                           f"cp={trainer.layout.cp} pp={trainer.layout.pp} dp={trainer.layout.dp} ep={trainer.layout.ep}, "
                           f"zero={cfg.parallel.zero}; data {dataset.source} (unigram entropy "
                           f"{dataset.unigram_entropy():.3f} nats){note}")
            logger.message(trainer.assignment.message)
            if dev.type == "cuda":
                logger.message(f"kernels: {trainer.kernels.describe()}")
        first = last = None
        saved_at = start_step if latest is not None else -1
        done = start_step
        start = time.time()
        for step in range(start_step, last_step):
            profiler.before(step + 1)
            t0 = time.time()
            result = trainer.train_step(step)
            done = step + 1
            if result.skipped and logger is not None:
                logger.message(f"step {step + 1}: loss is {result.loss}; update skipped ([train].nan_policy=skip)")
            first = result.loss if first is None else first
            last = result.loss
            if logger is not None:
                logger.log(step + 1, result.loss, step_time=time.time() - t0, lr=result.lr, grad_norm=result.grad_norm,
                           **result.moe, **result.timing, **trainer.sampler.shares(step + 1))
            profiler.after(step + 1)  # after the log line: writing the trace is not the step's time
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
                    logger.message(f"{stops.signal or 'a signal to another rank'}: stopped after step {done}, "
                                   f"checkpoint written")
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
        comm.barrier(None)  # only on success: a failed rank must not wait here for peers stuck in a step's collective
        return {"rank": rank, "first_loss": first, "last_loss": last, "seconds": time.time() - start, "steps": done}
    finally:
        watching.close()
        stops.close()
        shutdown()


def _watch(cfg, rank: int):
    """The watch over every collective: the flight recorder (pretrain.hang) and the step timing's waits."""
    if cfg.log.flight_records:
        return flight_recorder(cfg.log.dir, rank, cfg.log.flight_records)
    return CommWatch(0) if cfg.log.timing else nullcontext()


def _wandb_init(cfg, layout) -> dict | None:
    """W&B's init arguments ([log] wandb): project, name, tags, and the config and layout as its config."""
    if not cfg.log.wandb:
        return None
    config = cfg.to_dict() | {"layout": {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp,
                                         "ep": layout.ep, "micro_batch": layout.micro_batch,
                                         "microbatches": layout.microbatches}}
    return {"project": cfg.log.wandb_project, "name": cfg.log.wandb_name or None, "tags": list(cfg.log.wandb_tags),
            "config": config}
