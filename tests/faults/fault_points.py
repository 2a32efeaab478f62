"""Rank entries that hurt one rank at one phase of one step; patched into the rank processes only.

``tools/faults.py`` (and the fault tests) put ``functools.partial(fault_at, phase, rank, step)`` in
place of ``pretrain.training.run.run_rank`` in the launcher; the launcher sends it to each rank by reference
(this folder is on the launcher's ``sys.path``, which the forkserver's children inherit).
"""

import os
import signal
from pathlib import Path

PHASES = ("forward", "backward", "optimizer", "checkpoint", "upload", "sigstop")


def fault_at(phase: str, rank: int, step: int, *run_args) -> dict:
    """``run_rank(*run_args)``, except that ``rank`` SIGKILLs itself in ``phase`` of its (1-based) ``step``:
    the forward, the backward or the optimizer step of that step; writing the checkpoint of ``step``
    (its own part written, before the rename); its background write (``[checkpoint].async_save``);
    or ``sigstop``: it stops (SIGSTOP) at that step's forward and never answers again."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from pretrain.checkpoint import store
    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    now = {"step": 0}

    def here(at_step: int = step) -> bool:
        return dist.get_rank() == rank and now["step"] == at_step

    def die() -> None:
        os.kill(os.getpid(), signal.SIGSTOP if phase == "sigstop" else signal.SIGKILL)

    def wrap(owner, name: str, when) -> None:
        original = getattr(owner, name)

        def hurt(*args, **kwargs):
            if when(*args, **kwargs):
                die()
            return original(*args, **kwargs)

        setattr(owner, name, hurt)

    if phase in ("forward", "sigstop"):
        wrap(Trainer, "forward_chunk", lambda *a, **k: here())
    elif phase == "backward":
        wrap(torch.Tensor, "backward", lambda *a, **k: here())
    elif phase == "optimizer":
        wrap(Trainer, "train_step", lambda self, s: here() and setattr(self.model.dp, "step", die))
    elif phase == "checkpoint":  # the synchronous save: after this rank's pieces are written
        save_pieces = store.save_pieces
        store.save_pieces = lambda sd, path, *a, **k: (save_pieces(sd, path, *a, **k),
                                                        Path(path).name == f"step_{step}.tmp" and here() and die())[0]
    elif phase == "upload":  # DCP's write of this rank's files, in the background thread of an async save
        wrap(FileSystemWriter, "write_data", lambda self, *a, **k: Path(self.path).name == f"step_{step}.tmp"
             and dist.get_rank() == rank)  # not here(): training has gone on to the next step meanwhile
    else:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    wrap(Trainer, "train_step", lambda self, s: now.update(step=s + 1))  # outermost: the step is known first
    return run_rank(*run_args)


def slow_steps(seconds: float, *run_args) -> dict:
    """``run_rank(*run_args)`` with every step ``seconds`` longer (same math): time for a signal to land mid-run."""
    import time

    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    train_step = Trainer.train_step
    Trainer.train_step = lambda self, s: (time.sleep(seconds), train_step(self, s))[1]
    return run_rank(*run_args)
