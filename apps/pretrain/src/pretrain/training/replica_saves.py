"""A background checkpoint (``[checkpoint].async_save``) across a regroup of ``[train].fault_tolerance = "replica"``.

The save in flight belongs to the old generation: its DCP writer and publishing threads run collectives over
a checkpoint-only group of the old members. At an admission every member is alive, so it is finished first.
After a loss its collectives fail with the lost peer: the save is taken from the saver, its group let go with
the others (so a survivor's thread waiting on this rank fails at once), and its thread waited for, so that
nothing of the old generation writes into the checkpoint folder once the new one saves. If it was not
published (rank 0 of the old generation renames it once every rank's files are written), the new generation
writes the checkpoint of the agreed step again: a save a loss interrupted is never lost, and never mixes
files of two generations.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from par_groups import comm


def take_save(saver, error: BaseException | None):
    """Before the old generation's groups go: the save in flight finished (an admission, ``error`` None), or
    taken from ``saver`` (a loss) for :func:`unpublished`; returns it, or None."""
    if saver is None or not saver.background:
        return None
    if error is None:
        saver.finish()
        return None
    pending, saver.pending = saver.pending, None
    return pending


def holders(saver, pending) -> tuple:
    """The objects holding an old generation's checkpoint group (``_leave_groups`` drops them)."""
    return tuple(x for x in (saver, pending) if x is not None and getattr(x, "group", None) is not None)


def unpublished(pending) -> int | None:
    """Once the old groups are gone: wait for the taken save's thread (it ends once its collectives fail) and
    return its step if it was not published, as this rank sees it."""
    if pending is None:
        return None
    pending.thread.join()
    pending.error = pending.future = None  # their tracebacks hold the old group
    return None if pending.final.is_dir() else int(pending.state["step"])


def agreed_unpublished(saver, unsaved: int | None, error: BaseException | None, control) -> int | None:
    """After a loss (``error``), in the new generation: the new rank 0's view (it is the old rank 0 where that
    one lives, the only one that publishes), told to every member over ``control`` (the generation's gloo group:
    the device group may be NCCL, which refuses a host tensor)."""
    if error is None or saver is None or not saver.background:
        return None
    flag = torch.tensor([unsaved if unsaved is not None and dist.get_rank() == 0 else -1], dtype=torch.int64)
    comm.all_reduce(flag, control, op=dist.ReduceOp.MAX)
    return None if int(flag[0]) < 0 else int(flag[0])


def reopen(saver, timeout_s: float) -> None:
    """The saver's checkpoint-only group in the new generation (a replacement's saver makes its own at the
    same point: after the regroup's agreement)."""
    if saver is not None and saver.background:
        saver.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
