"""What every rank runs for `pretrain train`: join the group, train, evaluate, log, checkpoint, leave."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack, nullcontext

import torch.distributed as dist
from par_groups import comm
from par_groups.watch import CommWatch

# imported here, not in run_rank: the launcher's forkserver preloads this module once for all ranks
from ..checkpoint import CheckpointSaver, resolve_checkpoint
from ..checkpoint.resume import resume_latest, unverified_note
from ..checkpoint.retention import start_run
from ..config import load_config
from ..data import load_dataset
from ..sizing.flops import training_flops_per_step
from ..runtime.hang import flight_recorder, nccl_flight_env
from ..runtime.dead_rank import hold_stop_signals, start_heartbeat
from ..runtime.launch import device_type, init_distributed, shutdown
from ..runtime.rank_env import LAUNCHER_ENV
from ..observe.metrics import MetricsLogger
from ..observe.peak import matmul_dtype, peak_flops
from ..runtime.preempt import StopRequests
from .preflight import checkpoint_root
from ..observe.profile_window import ProfileWindow
from ..observe.step_timing import StepTimer
from .step_clock import StepClock
from .fault_replica import attempt, freeze_imports, join_distributed, joining, replica_run
from .train_loop import Trainer

# A signal stops the run within this many steps (or [log].every, if fewer): the ranks agree on it
# with a small collective and a host read, not at every step (each host read stalls a GPU's queue).
PREEMPT_CHECK_STEPS = 10


def run_rank(config: str | None, overrides: list[str], device: str | None = None, force: bool = False) -> dict:
    """Train per the config on this rank; rank 0 logs. Returns first/last loss and timings.

    ``device`` (the CLI's --device) overrides [train].device. ``force``: start a new run in a checkpoint directory holding another run's checkpoints."""
    cfg = load_config(config, overrides)
    freeze_imports(cfg)  # under fault tolerance: a regroup's collection walks the run's objects only
    if device_type(device or cfg.train.device) == "cuda":
        os.environ.update(nccl_flight_env(cfg.log.dir))  # NCCL's flight recorder too (read at group creation)
    t = cfg.train
    rank, world, _, dev = (join_distributed(cfg, device) if joining() else  # a lost replica's replacement
                           init_distributed(t.collective_timeout_s, device or t.device, t.join_timeout_s))
    stops = StopRequests(t.collective_timeout_s)  # from here a signal means: save after the next step
    watching = ExitStack()
    try:
        watch = watching.enter_context(_watch(cfg, rank))  # over every collective of the run
        replica = replica_run(cfg, stops, dev)  # [train].fault_tolerance: a lost replica's steps go on without it
        dataset = load_dataset(cfg.data, cfg.model.vocab_size)  # (after: its connections are not the groups')
        trainer = (replica.trainer if replica else Trainer)(cfg, dataset=dataset, device=dev,
                                                            timer=StepTimer(watch, dev) if cfg.log.timing else None)
        if watch is not None:
            watch.name_groups(trainer.groups.ranks)  # "tp", "dp", "pp" ... in records and traces
        profiler = ProfileWindow(cfg, rank, dev, watch)
        t, ck = cfg.train, cfg.checkpoint
        root = checkpoint_root(cfg)
        start_step, note = 0, ""
        latest, start_step, why = resume_latest(trainer.checkpointed(), root, ck.fallback) if ck.resume and not joining() else (None, 0, "")
        if joining():  # a replacement: its state and step came from a live replica
            start_step = replica.joined_at
        elif latest is not None:
            note = f"; resumed from {latest} at step {start_step}{why}"
        elif ck.init_from:
            trainer.load_checkpoint(ck.init_from, model_only=True)
            note = f"; weights from {ck.init_from}" + unverified_note(resolve_checkpoint(ck.init_from))
        saver = CheckpointSaver(ck.async_save, t.collective_timeout_s)  # async: one save in flight, published once written
        if replica:
            replica.saver = saver
        last_step = t.stop_at or t.steps

        def open_log(start: int, run_id: str) -> MetricsLogger:
            return MetricsLogger(
                cfg.log.dir, total_steps=t.steps, devices=world, device=dev, every=cfg.log.every,
                flops_per_step=training_flops_per_step(cfg.model, t.seq_len, t.global_batch),
                peak_flops_per_device=peak_flops(dev, matmul_dtype(trainer.autocast, cfg.train.fp8), cfg.log.peak_tflops),
                tokens_per_step=t.global_batch * t.seq_len, progress=cfg.log.progress, tensorboard=cfg.log.tensorboard,
                start_step=start, run_id=run_id, wandb=_wandb_init(cfg, trainer.layout),
            )

        logger = None
        if rank == 0 and not joining():
            logger = open_log(start_step, start_run(root, resuming=ck.resume, force=force))  # refuses another run's directory
            logger.message(f"pretrain: {world} rank{'s' * (world != 1)}: tp={trainer.layout.tp} "
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
        clock = StepClock()  # the step time in the log: what runs between steps is left out
        if replica:  # the log goes on at the next rank 0 when rank 0's replica is lost
            logger = replica.log(logger, lambda done: open_log(done, start_run(root, resuming=True, force=force)))
        steps = replica.steps(start_step, last_step, trainer) if replica else range(start_step, last_step)
        for step in steps:
            with attempt(steps, step, trainer):  # a lost replica: regrouped, back to the agreed step boundary
                with clock.paused():  # starting a profile is not the step's time
                    profiler.before(step + 1)
                result = trainer.train_step(step)
                done = step + 1
                clock.count_step()
                first = result if first is None else first
                _note_step(logger, result, done)
                # Values are read on the host at log steps only (and checked finite there): see step_result.py
                logged = trainer.log_step(done)
                if logged:
                    last = _log_step(trainer, logger, saver, result, done, clock)
                profiler.after(done)  # after the log line: writing the trace is not the step's time
                evaluated = bool(t.eval_every) and (done % t.eval_every == 0 or done == last_step)
                if evaluated:
                    _evaluate(trainer, logger, t.eval_batches, done)
                checkpoint_step = bool(ck.every and done % ck.every == 0)
                # Pre-emption: the ranks agree every PREEMPT_CHECK_STEPS steps (and at log and checkpoint steps)
                preempted = (checkpoint_step or done % min(cfg.log.every, PREEMPT_CHECK_STEPS) == 0) and stops.agreed()
                if checkpoint_step or preempted:
                    _save(trainer, saver, logger, root, done, ck.keep)
                    saved_at = done
                if preempted:
                    _stop(saver, logger, stops, done)
                    break
                if logged or evaluated or checkpoint_step:
                    clock.restart()  # the log line, the trace, the evaluation and the save were not steps
        first = None if first is None else first.loss
        if getattr(trainer.sampler, "test", None) is not None and done == last_step:  # [data].split's test part: once, at the end
            _evaluate(trainer, logger, t.eval_batches, done, split="test")
        if last is None and done > start_step:  # stopped by a signal between log steps
            last = result.loss
        if saved_at != done:  # always a final checkpoint: `convert --to-hf` and resume work after any run
            _save(trainer, saver, logger, root, done, ck.keep, final=True)
        finished = saver.close()  # the last background save, published once every rank has written it; pruning done
        if finished is not None and logger is not None:
            logger.message(f"checkpoint {finished} complete; training thread waited {saver.last_blocked_s:.2f} s")
        if logger is not None:
            if first is not None:
                logger.message(f"done: {done - start_step} steps in {time.time() - start:.1f} s, "
                               f"loss {first:.4f} -> {last:.4f}")
            logger.close()
        comm.barrier(None)  # only on success: a failed rank must not wait here for peers stuck in a step's collective
        if replica:
            replica.finished()
        return {"rank": rank, "first_loss": first, "last_loss": last, "seconds": time.time() - start, "steps": done}
    except BaseException:
        hold_stop_signals()  # under torchrun: its SIGTERM must not end this rank before it names a dead peer
        raise
    finally:
        watching.close()
        stops.close()
        shutdown()


def _note_step(logger, result, done: int) -> None:
    """What a step did besides training, for the log: a re-placement of experts, an update skipped."""
    if logger is None:
        return
    if result.placement is not None:  # a re-placement step (one host read done)
        logger.log_event("expert_placement", **result.placement)
    if result.skipped:  # nan_policy=skip has read the flag already
        logger.message(f"step {done}: loss is {result.loss}; update skipped ([train].nan_policy=skip)")


def _log_step(trainer, logger, saver, result, done: int, clock: StepClock):
    """A log step (every rank): the finite check, the step timing gathered; rank 0 writes the line. Returns the loss."""
    trainer.check_finite()
    timing = trainer.timer.gathered()
    blocked = saver.take_blocked()  # the saves since the last log line: the training thread's wait
    if logger is not None:  # the step time: the mean since the last log line (the GPU's, not the launches')
        logger.log(done, result.loss, step_time=clock.mean_step_s(), lr=result.lr, grad_norm=result.grad_norm,
                   **result.moe, **timing, **trainer.sampler.shares(done), **trainer.integrity.take(),
                   **({"time_checkpoint": blocked} if blocked is not None else {}))
    return result.loss


def _evaluate(trainer, logger, batches: int, done: int, split: str = "valid") -> None:
    """The held-out loss (``split="test"``: [data].split's test part) after ``done`` steps, logged by rank 0."""
    loss = trainer.evaluate(batches, split=split)
    if logger is None:
        return
    if split == "test":
        logger.log_eval(done, loss, split="test")
    else:
        logger.log_eval(done, loss, held_out=trainer.sampler.held_out)


def _save(trainer, saver, logger, root, done: int, keep: int, final: bool = False) -> None:
    """The checkpoint after ``done`` steps (never one after a non-finite step); ``final``: the run's last."""
    trainer.check_finite()
    path = saver.save(trainer.checkpointed(), root, done, keep)
    if logger is None:
        return
    background = " (writing in the background)" if saver.background and not final else ""
    logger.message(f"checkpoint {path}{background}; training thread blocked {saver.last_blocked_s:.2f} s")


def _stop(saver, logger, stops, done: int) -> None:
    """A pre-emption: the checkpoint just started is published before the run exits."""
    saver.finish()
    if logger is not None:
        logger.message(f"{stops.signal or 'a signal to another rank'}: stopped after step {done}, "
                       f"checkpoint written")


def _watch(cfg, rank: int):
    """The watch over every collective: the flight recorder (pretrain.runtime.hang) and the step timing's waits."""
    if cfg.log.flight_records:
        watch = flight_recorder(cfg.log.dir, rank, cfg.log.flight_records)
        if LAUNCHER_ENV not in os.environ and dist.get_world_size() > 1:  # torchrun: no launcher of ours sees a rank die
            start_heartbeat(cfg.log.dir, rank, dist.get_world_size(), watch)
        return watch
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
