"""Rank entries that SIGKILL one rank of a fault-tolerant run at a chosen step and phase; the patches live
in the rank processes only (imported by name there, as ``fault_ranks``)."""

import os
import signal
from pathlib import Path

PHASES = ("forward", "backward", "reduction", "optimizer")


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def sigkill_at(rank: int, step: int, phase: str, pid_dir: str, *run_args) -> dict:
    """``run_rank(*run_args)``, except that ``rank`` (the launcher's numbering) SIGKILLs itself in ``phase`` of
    its (1-based) ``step``: the forward, the backward, the gradients' reduction (its first bucket's
    all-reduce) or the optimizer step. Every rank writes its pid to ``pid_dir`` first."""
    from par_groups import comm
    from par_zero.data_parallel import DataParallel

    from pretrain.training.fault_replica import ReplicaTrainer
    from pretrain.training.run import run_rank

    Path(pid_dir, str(os.getpid())).touch()
    me, now = int(os.environ["RANK"]), {"step": 0}
    due = lambda wanted: wanted == phase and (me, now["step"]) == (rank, step)  # noqa: E731

    train_step, forward_chunk, loss = ReplicaTrainer.train_step, ReplicaTrainer.forward_chunk, ReplicaTrainer.loss
    all_reduce, dp_step = comm.all_reduce, DataParallel.step

    def stepping(self, s):
        now["step"] = s + 1
        return train_step(self, s)

    def forwarding(self, *a, **kw):
        if due("forward"):
            _sigkill()
        return forward_chunk(self, *a, **kw)

    def lossing(self, *a, **kw):
        out = loss(self, *a, **kw)
        if due("backward") and out.requires_grad:
            out.register_hook(lambda grad: _sigkill())
        return out

    def reducing(tensor, *a, **kw):
        if due("reduction") and tensor.numel() > 1:
            _sigkill()
        return all_reduce(tensor, *a, **kw)

    def updating(self, *a, **kw):
        if due("optimizer"):
            _sigkill()
        return dp_step(self, *a, **kw)

    ReplicaTrainer.train_step, ReplicaTrainer.forward_chunk, ReplicaTrainer.loss = stepping, forwarding, lossing
    comm.all_reduce, DataParallel.step = reducing, updating
    return run_rank(*run_args)
