"""Checkpoints written in the background (``[checkpoint].async_save = true``).

The training thread copies the pieces this rank owns into staging buffers (:class:`Staging`:
allocated at the first save and reused by every later one; pinned when the state lives on a GPU,
whose copies are queued on the current stream and waited for by the writer thread, not the
training thread) and writes its small RNG file. DCP then plans and writes the files in a
background thread over a gloo group used only for checkpoints, so its collectives never run at the
same time as training collectives on the same group; the data files are hashed as they are written
(:class:`.hashing_writer.HashingWriter`).

The save stays crash safe the same way as the synchronous one: the files go to ``step_N.tmp``, and
the rename and the ``latest`` marker happen as soon as every rank's write has completed, in a
publishing thread of each rank (:class:`PendingSave`), not at the next save: a crash between two
saves loses nothing that was written. The pruning follows the publish's final barrier, in a thread
of rank 0. The trainer waits for a pending save (its publish included) before starting the next
one (so the staging buffers are free again), before a pre-emption exit and before the run ends; a
crash before the publish leaves the previous ``latest`` untouched.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from par_groups import comm
from par_zero import Pieces, PiecesSavePlanner

from .faults import removed_if_disk_full
from .hashing_writer import HashingWriter
from .retention import prune_in_background, wait_pruned
from .rng_state import rng_state
from .store import (checkpoint_tensors, _finalise, _prepare, _quiet, _rank, gather_digests, rank_entries,
                    save_checkpoint, trainer_state)
from .subject import Checkpointed


class Staging:
    """CPU buffers an async save copies this rank's owned state into: fp32 (what a checkpoint holds),
    one per box, allocated on first use and reused while the boxes keep their shapes; page-locked
    (pinned) for state on a GPU, so the copies run asynchronously on its stream. A save must be
    finished before the next :meth:`stage` (CheckpointSaver does so)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, sd: dict[str, Pieces]) -> tuple[dict[str, Pieces], torch.cuda.Event | None]:
        """``sd``'s boxes copied into the buffers; a CUDA event to wait for before reading them (None: done)."""
        out, buffers, gpu = {}, {}, False
        for key, pieces in sd.items():
            boxes = []
            for offsets, t in pieces.boxes:
                offsets = tuple(offsets)
                buf = self.buffers.get((key, offsets))
                if buf is None or buf.shape != t.shape:
                    buf = torch.empty(t.shape, dtype=torch.float32, pin_memory=t.is_cuda)
                buf.copy_(t.detach(), non_blocking=t.is_cuda)
                gpu |= t.is_cuda
                buffers[(key, offsets)] = buf
                boxes.append((offsets, buf))
            out[key] = Pieces(pieces.full_shape, boxes)
        self.buffers = buffers  # boxes no longer saved are let go
        event = None
        if gpu:
            event = torch.cuda.Event()
            event.record()  # after the copies on the current stream; training's next kernels queue behind them
        return out, event

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class _Staged(AsyncStager):
    """The blocks are already in the staging buffers: DCP need not copy them again. With GPU copies in
    flight, the writer thread waits for their event (a future DCP's save waits on), not the training thread."""

    _synchronize_after_execute = False

    def __init__(self, event=None) -> None:
        self.event = event

    def stage(self, state_dict):
        if self.event is None:
            return state_dict
        staged, event = Future(), self.event

        def wait() -> None:
            try:
                event.synchronize()
                staged.set_result(state_dict)
            except BaseException as e:  # noqa: BLE001 -- DCP's save re-raises it
                staged.set_exception(e)

        threading.Thread(target=wait, name="checkpoint-staging", daemon=True).start()
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingSave:
    """A checkpoint whose files are being written; a thread on every rank publishes it once they are.

    How the ranks agree that every rank's files are written and hashed: over the checkpoint-only
    gloo group, from this thread (gather the digests on rank 0, which writes ``checksums.json``,
    renames and replaces ``latest``; then a barrier). That group's collectives never meet the
    training thread's: they run only in DCP's writer thread and in this one, one after the other on
    each rank (the publisher starts once DCP's save has returned here, and the next save starts only
    after :meth:`finish` has joined it), so each rank issues them in the same order. No file markers
    to poll, no timeout of our own (the group's is ``[train].collective_timeout_s``), and the
    training thread reads nothing on the host for it."""

    def __init__(self, future: Future, root: Path, tmp: Path, final: Path, state: dict, keep: int, group) -> None:
        self.future, self.root, self.tmp, self.final = future, root, tmp, final  # future: this rank's digests
        self.state, self.keep, self.group = state, keep, group
        self.error: BaseException | None = None
        # a daemon: a rank that fails mid-save exits without waiting for a peer that will never gather
        self.thread = threading.Thread(target=self._publish, name="checkpoint-publish", daemon=True)
        self.thread.start()

    def _publish(self) -> None:
        try:
            pruned = []
            with removed_if_disk_full(self.tmp):
                entries = self.future.result()  # this rank's files are written and hashed (or the writer's error)
                entries = gather_digests(entries, self.group)  # ... and every rank's
                if _rank() == 0:
                    pruned = _finalise(self.root, self.tmp, self.final, self.state, self.keep, entries)
            comm.barrier(self.group)
            if _rank() == 0:
                prune_in_background(self.root, pruned)  # only published saves older than the last ``keep``
        except BaseException as e:  # noqa: BLE001 -- raised on the training thread by finish()
            self.error = e

    def finish(self) -> Path:
        """Wait until the checkpoint is published (all ranks); its error, if it failed, is raised here."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.final


@_quiet
def start_async_save(state: Checkpointed, root: str | Path, step: int, keep: int, group, staging: Staging | None = None) -> PendingSave:
    """Begin writing ``root/step_<step>`` in the background (all ranks call it); ``group``: a gloo group
    used for nothing but checkpoints; ``staging``: the buffers to reuse (new ones if None)."""
    root = Path(root)
    final, tmp = _prepare(root, step)
    sd, event = (staging or Staging()).stage(checkpoint_tensors(state, with_optim=True))
    with removed_if_disk_full(tmp):
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
    writer = HashingWriter(tmp)
    response = dcp.async_save(sd, checkpoint_id=str(tmp), storage_writer=writer, process_group=group,
                              async_stager=_Staged(event), planner=PiecesSavePlanner())
    future = getattr(response, "upload_completion", response)  # an AsyncSaveResponse or a Future
    return PendingSave(_digests_once_written(future, writer, tmp), root, tmp, final, trainer_state(state, step),
                       keep, group)


def _digests_once_written(written: Future, writer: HashingWriter, tmp: Path) -> Future:
    """A future of this rank's file digests, set once ``written`` (DCP's future) is done: the data files'
    were taken as they were written, the small RNG file is hashed then (in DCP's thread)."""
    hashed = Future()

    def done(f: Future) -> None:
        try:
            f.result()
            hashed.set_result(rank_entries(writer, tmp))
        except BaseException as e:  # noqa: BLE001 -- the writer's error is re-raised by finish()
            hashed.set_exception(e)

    written.add_done_callback(done)
    return hashed


class CheckpointSaver:
    """The run's checkpoint writer: synchronous, or (``background``) one save in flight at a time.

    ``blocked_s``: the seconds the calling (training) thread spent in :meth:`save` and :meth:`finish`
    since :meth:`take_blocked` last read them (``time_checkpoint`` in the run's log)."""

    def __init__(self, background: bool, timeout_s: float = 300.0) -> None:
        self.background = background and dist.is_initialized()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.background else None
        self.pending: PendingSave | None = None
        self.staging = Staging()
        self.blocked_s = 0.0
        self.last_blocked_s = 0.0  # the last save's (or finish's) own

    def save(self, state: Checkpointed, root: str | Path, step: int, keep: int) -> Path:
        """Start (background) or write the checkpoint of ``state`` after ``step`` steps; a save still in flight
        is finished first."""
        began = time.perf_counter()
        try:
            self._finish()
            if not self.background:
                return save_checkpoint(state, root, step, keep)
            self.pending = start_async_save(state, root, step, keep, self.group, self.staging)
            return self.pending.final
        finally:
            self._blocked(began)

    def finish(self) -> Path | None:
        """Wait until the save in flight, if any, is published; returns its path."""
        began = time.perf_counter()
        try:
            return self._finish()
        finally:
            self._blocked(began)

    def close(self) -> Path | None:
        """:meth:`finish`, then wait for the pruning in flight (the end of a run); returns the path finished."""
        began = time.perf_counter()
        try:
            finished = self._finish()
            wait_pruned()
            return finished
        finally:
            self._blocked(began)

    def take_blocked(self) -> float | None:
        """The blocked seconds since the last call (None if no save or finish ran), and start again."""
        blocked, self.blocked_s = self.blocked_s, 0.0
        return blocked or None

    def _finish(self) -> Path | None:
        pending, self.pending = self.pending, None
        return pending.finish() if pending is not None else None

    def _blocked(self, began: float) -> None:
        self.last_blocked_s = time.perf_counter() - began
        self.blocked_s += self.last_blocked_s
