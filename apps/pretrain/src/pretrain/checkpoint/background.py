"""Checkpoints written in the background (``[checkpoint].async_save = true``).

The training thread copies the pieces this rank owns into private CPU copies (no collective) and
writes its small RNG file. DCP then plans and writes the files in a background thread over a gloo group used only for checkpoints, so its collectives never
run at the same time as training collectives on the same group.

The save stays crash safe the same way as the synchronous one: the files go to ``step_N.tmp``, and
the rename, the ``latest`` marker and the pruning happen in :meth:`PendingSave.finish`, once every
rank's write has completed. Each rank hashes its files for ``checksums.json`` in the background too,
right after its write. The trainer finishes a pending save before starting the next one,
before a pre-emption save and before the run ends; a crash before that leaves the previous
``latest`` untouched.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from par_groups import comm
from par_zero import PiecesSavePlanner

from .faults import removed_if_disk_full
from .integrity import digests, rank_files
from .store import checkpoint_tensors, _finalise, _prepare, _quiet, _rank, gather_digests, rng_state, trainer_state


class _AlreadyStaged(AsyncStager):
    """The blocks are already private CPU copies: DCP need not copy them again."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingSave:
    """A checkpoint whose files are being written; :meth:`finish` (all ranks) publishes it."""

    def __init__(self, future: Future, root: Path, tmp: Path, final: Path, state: dict, keep: int, group) -> None:
        self.future, self.root, self.tmp, self.final = future, root, tmp, final  # future: this rank's digests
        self.state, self.keep, self.group = state, keep, group

    def finish(self) -> Path:
        with removed_if_disk_full(self.tmp):
            entries = self.future.result()  # this rank's files are written and hashed (or the writer's error)
            entries = gather_digests(entries, self.group)  # ... and every rank's
            if _rank() == 0:
                _finalise(self.root, self.tmp, self.final, self.state, self.keep, entries)
        comm.barrier(self.group)
        return self.final


@_quiet
def start_async_save(trainer, root: str | Path, step: int, keep: int, group) -> PendingSave:
    """Begin writing ``root/step_<step>`` in the background (all ranks call it); ``group``: a gloo group
    used for nothing but checkpoints."""
    root = Path(root)
    final, tmp = _prepare(root, step)
    sd = checkpoint_tensors(trainer, with_optim=True, copy=True)
    with removed_if_disk_full(tmp):
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
    response = dcp.async_save(sd, checkpoint_id=str(tmp), process_group=group, async_stager=_AlreadyStaged(),
                              planner=PiecesSavePlanner())
    future = getattr(response, "upload_completion", response)  # an AsyncSaveResponse or a Future
    return PendingSave(_hashed_once_written(future, tmp), root, tmp, final, trainer_state(trainer, step), keep, group)


def _hashed_once_written(written, tmp: Path) -> Future:
    """A future of this rank's file digests, computed in a thread once ``written`` (DCP's future) is done."""
    hashed, rank = Future(), _rank()

    def run() -> None:
        try:
            written.result()
            hashed.set_result(digests(tmp, rank_files(tmp, rank)))
        except BaseException as e:  # noqa: BLE001 -- the writer's error is re-raised by finish()
            hashed.set_exception(e)

    threading.Thread(target=run, name="checkpoint-hash", daemon=True).start()
    return hashed


class CheckpointSaver:
    """The run's checkpoint writer: synchronous, or (``background``) one save in flight at a time."""

    def __init__(self, background: bool, timeout_s: float = 300.0) -> None:
        self.background = background and dist.is_initialized()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.background else None
        self.pending: PendingSave | None = None

    def save(self, trainer, root: str | Path, step: int, keep: int) -> Path:
        """Start (background) or write the checkpoint of ``step``; a save still in flight is finished first."""
        self.finish()
        if not self.background:
            return trainer.save_checkpoint(root, step, keep)
        self.pending = start_async_save(trainer, root, step, keep, self.group)
        return self.pending.final

    def finish(self) -> Path | None:
        """Wait for the save in flight, if any, and publish it; returns its path."""
        pending, self.pending = self.pending, None
        return pending.finish() if pending is not None else None
