"""Rank entries that inject a fault into pretrain's own ``run_rank``; the patches live in the rank
processes only, so no production path reads a test switch.

A CLI test puts one in place of ``pretrain.training.run.run_rank`` (``commands/train.py`` imports it at call
time) with ``functools.partial``; the launcher pickles it by reference, and each rank imports this
module by name (the ``fault_ranks`` fixture puts the tests folder on ``sys.path``, which the
forkserver's children inherit from the launcher).
"""

import os
import signal
from pathlib import Path


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def fail_before_step(rank: int, step: int, *run_args, held_write: tuple[str, int, int] | None = None) -> dict:
    """``run_rank(*run_args)``, except that ``rank`` raises before its (1-based) ``step``; ``held_write``:
    (folder, rank, step) of a background write held for good (:func:`hold_write`)."""
    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    if held_write is not None:
        hold_write(*held_write)

    train_step = Trainer.train_step

    def failing(self, s):
        if (_rank(), s + 1) == (rank, step):
            raise RuntimeError(f"injected failure on rank {rank} before step {step}")
        return train_step(self, s)

    Trainer.train_step = failing
    return run_rank(*run_args)


def die_after_writing(rank: int | None, step: int, die) -> None:
    """Make the synchronous save of ``step`` call ``die()`` on ``rank`` (None: every rank) once the
    checkpoint's pieces are written by every rank (DCP's save returns after its metadata is written)
    and before the rename. Patches ``pretrain.checkpoint.store`` in this process."""
    from pretrain.checkpoint import store

    save_pieces = store.save_pieces

    def dying(sd, path, *a, **kw):
        out = save_pieces(sd, path, *a, **kw)
        if Path(path).name == f"step_{step}.tmp" and rank in (None, _rank()):
            die()
        return out

    store.save_pieces = dying


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def sigkill_in_save(rank: int, step: int, *run_args) -> dict:
    """``run_rank(*run_args)``, except that ``rank`` SIGKILLs itself mid-save of ``step`` (after writing its part)."""
    from pretrain.training.run import run_rank

    die_after_writing(rank, step, sigkill)
    return run_rank(*run_args)


def slow_data(rank: int, seconds: float, *run_args) -> dict:
    """``run_rank(*run_args)``, except that ``rank`` sleeps ``seconds`` in every step's data step."""
    import time

    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    batch = Trainer._batch

    def slow(self, step, eval=False):
        if _rank() == rank and not eval:
            time.sleep(seconds)
        return batch(self, step, eval)

    Trainer._batch = slow
    return run_rank(*run_args)


def stop_before_step(rank: int, step: int, *run_args) -> dict:
    """``run_rank(*run_args)``, except that ``rank`` stops itself (SIGSTOP) before its (1-based) ``step``."""
    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    train_step = Trainer.train_step

    def stopping(self, s):
        if (_rank(), s + 1) == (rank, step):
            os.kill(os.getpid(), signal.SIGSTOP)
        return train_step(self, s)

    Trainer.train_step = stopping
    return run_rank(*run_args)


def inf_weight_before_step(step: int, *run_args) -> dict:
    """``run_rank(*run_args)``, with a norm weight set to inf on every rank before its (1-based) ``step``:
    that step's loss is not finite."""
    import torch

    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    train_step = Trainer.train_step

    def poisoned(self, s):
        if s + 1 == step:
            with torch.no_grad():
                for name, p in self.model.module.named_parameters():
                    if "norm" in name:
                        p.fill_(float("inf"))
        return train_step(self, s)

    Trainer.train_step = poisoned
    return run_rank(*run_args)


def _held_for_good(folder: str, marker: str) -> None:
    """Touch ``folder/marker`` and wait there until the test kills the process."""
    import time

    (Path(folder) / marker).touch()
    while True:
        time.sleep(0.05)


def hold_write(folder: str, rank: int, step: int) -> None:
    """Make ``rank``'s background write of ``step`` stop for good once its files are written, before
    DCP hears of it (after touching ``folder/writing_<rank>``). Patches ``HashingWriter`` in this process."""
    from pretrain.checkpoint.hashing_writer import HashingWriter

    write_data = HashingWriter.write_data

    def holding(self, plan, planner):
        written = write_data(self, plan, planner)
        if (_rank(), Path(self.path).name) == (rank, f"step_{step}.tmp"):
            written.wait()
            _held_for_good(folder, f"writing_{rank}")
        return written

    HashingWriter.write_data = holding


def hold(folder: str, before_step: int | None, write: tuple[int, int] | None, *run_args) -> dict:
    """``run_rank(*run_args)``, except that every rank's training thread stops for good before its
    (1-based) step ``before_step`` (after touching ``held_<rank>`` in ``folder``), and ``write`` =
    (rank, step) is held as :func:`hold_write` holds it: where a test kills the launcher."""
    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    train_step = Trainer.train_step

    def holding_step(self, s):
        if s + 1 == before_step:
            _held_for_good(folder, f"held_{_rank()}")
        return train_step(self, s)

    if write is not None:
        hold_write(folder, *write)
    Trainer.train_step = holding_step
    return run_rank(*run_args)


def injected(spec: str, *run_args) -> dict:
    """``run_rank(*run_args)`` with ``PAR_INJECT=spec`` in this rank (pretrain.observe.inject)."""
    from pretrain.observe.inject import ENV
    from pretrain.training.run import run_rank

    os.environ[ENV] = spec
    return run_rank(*run_args)
