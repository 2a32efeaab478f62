"""Distributed checkpoints that load under any layout.

A checkpoint directory ``DIR/step_N`` holds, written with torch.distributed.checkpoint (DCP):

- ``model/<hf name>``: every tensor of the FULL model (Hugging Face names), and
- ``optim/exp_avg/<hf name>``, ``optim/exp_avg_sq/<hf name>``: AdamW's moments in the same shape
  (another ``[train].optimizer``: its per-param state tensors, ``optim/<state name>/<hf name>``,
  e.g. SGD's ``momentum_buffer``; its scalar state, e.g. ``step``, in ``trainer_state.json``),

each rank contributing exactly the pieces it owns, with their global offsets: its tp / ep / etp
block (the placement each parameter declares) cut further by its ZeRO shard, written straight from
its buffers (par_zero's ``owned_pieces``: no gather, no full-size buffer), replicas once. Loading
under another layout reads only the stored chunks overlapping the pieces each new rank owns.
``trainer_state.json`` (step, format, config, layout) and ``rng/rank_R.pt`` (RNG states, read
back with ``weights_only=True``) complete it, and ``checksums.json`` (size and SHA-256 of every other
file, :mod:`.integrity`) is written last: a load checks the files it reads against it.

Crash safety: everything is written to ``step_N.tmp``, renamed to ``step_N`` once all ranks have
finished, and only then is the ``latest`` marker replaced (atomically); the last ``keep`` are kept,
the older ones deleted by rank 0 in a thread after the final barrier (:mod:`.retention`).

The data files are hashed as DCP writes them (:class:`.hashing_writer.HashingWriter`), not read back.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from par_groups import comm
from par_zero import AdamW, Pieces, load_pieces, save_pieces, whole_pieces

from ..errors import UsageError
from ..model.shapes import full_shapes
from ..runtime.safe_files import write_atomic
from .faults import first_failure, removed_if_disk_full
from .checked_reader import CheckedReader
from .compatible import check_compatible, check_optimizer_matches, check_stored_shapes
from .hashing_writer import HashingWriter
from .integrity import METADATA, DamagedCheckpoint, digests, first_damage, read_checksums, verify_files, write_checksums
from .retention import (FORMAT, LATEST, STATE_FILE, inside, prune_in_background, publish,  # noqa: F401 - read_state
                        read_state, run_id_of)
from .rng_state import load_rng_state, rng_state
from .subject import Checkpointed

ERROR_LOG = "error.log"  # in [log].dir: the traceback behind a one-line error
MAX_MARKER_BYTES = 4096  # ``latest`` holds one step_N name
ADAMW_STATE = AdamW().kinds()  # what a checkpoint without "optimizer_kinds" holds (AdamW's declared state)


def _quiet(fn):
    """Single-process DCP (``no_dist``) warns that torch.distributed is disabled: noise here."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*", category=UserWarning)
            return fn(*args, **kwargs)

    return wrapper


def _loaded_optimizers(dp) -> list:
    """The optimizers a load fills: the owned ranges' and, with ``[train].buddy_shards``, the buddy ranges'."""
    return [dp.optimizer_state] + ([dp.buddy_optimizer] if getattr(dp, "buddy_optimizer", None) is not None else [])


def _pieces(state: Checkpointed, with_optim: bool, buddies: bool = False) -> dict[str, Pieces]:
    """``model/<hf name>`` (and the optimizer state) of every tensor this rank holds: the pieces it owns.

    Trained params come from the optimizer's buffers (views); buffers and frozen params whole. ``buddies``
    (a load): the buddy ranges too (``[train].buddy_shards``), read from their owners' saved pieces."""
    dp = state.model.dp
    kinds = dp.optimizer_state.state_kinds() if with_optim else ()
    owned = {kind: dp.owned_pieces(kind) for kind in ("master",) + kinds}
    if buddies and getattr(dp, "buddy_optimizer", None) is not None:
        for kind in owned:
            for p, v in dp.buddy_pieces(kind).items():
                owned[kind][p] = Pieces(owned[kind][p].full_shape, owned[kind][p].boxes + v.boxes)
    shapes = full_shapes(state.cfg.model)
    out = {}
    for name, t in state.model.full_named_tensors().items():
        if t not in owned["master"]:
            out[f"model/{name}"] = unpadded(whole_pieces(t), shapes.get(name))
            continue
        out |= {f"model/{name}": unpadded(owned["master"][t], shapes.get(name))}
        out |= {f"optim/{kind}/{name}": unpadded(owned[kind][t], shapes.get(name)) for kind in kinds}
    return out


def unpadded(pieces: Pieces, shape: tuple[int, ...] | None) -> Pieces:
    """``pieces`` cut to the model's own ``shape``: the rows of vocabulary padding are not saved, so
    a checkpoint (and its Hugging Face export) holds vocab_size rows under any tp or vocab_pad_to."""
    if shape is None or tuple(pieces.full_shape) == tuple(shape):
        return pieces
    boxes = []
    for offsets, t in pieces.boxes:
        keep = [min(n, f - o) for o, n, f in zip(offsets, t.shape, shape)]
        if all(k > 0 for k in keep):
            for dim, k in enumerate(keep):
                t = t.narrow(dim, 0, k)
            boxes.append((offsets, t))
    return Pieces(tuple(shape), boxes)


def checkpoint_tensors(state: Checkpointed, with_optim: bool) -> dict[str, Pieces]:
    """What this rank writes: views of its buffers (an async save stages them: background.Staging)."""
    if state.experts is not None:  # every rank: the expert load, for the state file
        state.experts.note_for_save()
    return _pieces(state, with_optim)


def rank_entries(writer: HashingWriter, tmp: Path) -> dict[str, dict]:
    """This rank's files' digests: its data files' (hashed as written) and its RNG file's (small)."""
    rng = f"rng/rank_{_rank()}.pt"
    return writer.written | digests(tmp, [rng] if (tmp / rng).is_file() else [])


def _barrier() -> None:
    if dist.is_initialized():
        comm.barrier(None)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def trainer_state(state: Checkpointed, step: int) -> dict:
    """The state file's fields (``trainer_state.json``) of a save of ``state`` after ``step`` steps."""
    cfg, layout, dp = state.cfg, state.layout, state.model.dp
    opt = dp.optimizer_state
    return {"format": FORMAT, "step": step, "config": cfg.to_dict(), "world_size": layout.world_size,
            "layout": {k: getattr(layout, k) for k in ("tp", "cp", "pp", "dp", "ep", "etp", "vpp")},
            "zero": cfg.parallel.zero, "optimizer": True, "optimizer_steps": dp.step_count,
            "optimizer_name": cfg.train.optimizer, "optimizer_kinds": list(opt.state_kinds()),
            "optimizer_scalars": opt.scalar_state(),
            **({"expert_placement": state.experts.noted} if state.experts is not None else {})}


def _prepare(root: Path, step: int) -> tuple[Path, Path]:
    """(final, tmp) paths of the save of ``step``; rank 0 makes an empty ``tmp`` before any rank writes."""
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_entry(tmp)
        with removed_if_disk_full(tmp):
            tmp.mkdir()  # new: never a directory a symlink points to
            (tmp / "rng").mkdir()
    _barrier()
    return final, tmp


def _remove_entry(path: Path) -> None:
    """Remove what stands at ``path``: a symlink itself (not what it points to), or a directory tree."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def gather_digests(entries: dict[str, dict], group=None) -> dict[str, dict]:
    """Every rank's ``entries`` (its files' digests) on rank 0 of ``group`` once all have written; {} elsewhere."""
    if not dist.is_initialized():
        return entries
    first = dist.get_rank(group) == 0
    out = [None] * dist.get_world_size(group) if first else None
    comm.gather_object(entries, out, dist.get_global_rank(group, 0) if group is not None else 0, group)
    return {name: d for part in out for name, d in part.items()} if first else {}


def _finalise(root: Path, tmp: Path, final: Path, state: dict, keep: int, entries: dict[str, dict]) -> list[str]:
    """Rank 0, once every rank's files are in ``tmp`` (``entries``: their digests): state file (with the run's
    id), ``checksums.json``, rename, ``latest``; returns the saves to prune once every rank is past the save."""
    (tmp / STATE_FILE).write_text(json.dumps(state | {"run_id": run_id_of(root)}, indent=1))
    write_checksums(tmp, entries)
    _remove_entry(final)
    os.replace(tmp, final)
    return publish(root, final, keep)


@_quiet
def save_checkpoint(state: Checkpointed, root: str | Path, step: int, keep: int = 2) -> Path:
    """Write ``root/step_<step>`` (all ranks call it); returns its path."""
    root = Path(root)
    final, tmp = _prepare(root, step)
    sd, writer, pruned = checkpoint_tensors(state, with_optim=True), HashingWriter(tmp), []
    with removed_if_disk_full(tmp):
        save_pieces(sd, str(tmp), storage_writer=writer)
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
        entries = gather_digests(rank_entries(writer, tmp))  # also: every rank has written
        if _rank() == 0:
            pruned = _finalise(root, tmp, final, trainer_state(state, step), keep, entries)
    _barrier()
    if _rank() == 0:
        prune_in_background(root, pruned)  # after the barrier: no rank waits for the deleting
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint the ``latest`` marker of ``root`` names (None if there is none)."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    try:
        with open(marker, "rb") as f:
            raw = f.read(MAX_MARKER_BYTES + 1)
        if len(raw) > MAX_MARKER_BYTES:
            raise ValueError(f"more than {MAX_MARKER_BYTES} bytes, not a checkpoint's name")
        name = raw.decode().strip()
    except (OSError, ValueError) as e:
        raise UsageError(f"checkpoint marker {marker} is unreadable ({e}); move it away") from None
    path = inside(Path(root), name, f"checkpoint marker {marker}")
    if not (path / STATE_FILE).is_file():
        raise DamagedCheckpoint(f"checkpoint marker {marker} names {path.name}, which is missing or incomplete")
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run's checkpoint root holding a ``latest`` marker."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        raise UsageError(f"{path} is not a checkpoint (no {STATE_FILE}) nor a directory with a '{LATEST}' marker")
    return latest


@_quiet
@torch.no_grad()
def load_checkpoint(into: Checkpointed, path: str | Path, model_only: bool = False) -> int:
    """Load a checkpoint saved under any layout into ``into``'s buffers; returns the step to continue from.

    ``model_only`` (or a checkpoint without optimizer state) keeps fresh moments and starts at step 0."""
    path = resolve_checkpoint(path)
    cfg = into.cfg
    checksums = read_checksums(path, cfg.checkpoint.verify)  # None: older, and verify = false
    verify_files(path, [STATE_FILE, METADATA], checksums)
    state = read_state(path)
    check_compatible(path, state, cfg)
    dp = into.model.dp
    with_optim = state.get("optimizer", False) and not model_only
    if with_optim:
        check_optimizer_matches(path, state, cfg)
        for opt in _loaded_optimizers(dp):  # a torch.optim class's state is lazy; Muon's buddy state unpacked copies
            opt.prepare_load(state.get("optimizer_kinds", ADAMW_STATE))
    sd = _pieces(into, with_optim=with_optim, buddies=True)  # views of this rank's buffers: loading fills them in place
    stored = check_stored_shapes(path, sd)
    with_optim = with_optim and all(k in stored for k in sd)
    if not with_optim:
        sd = {k: v for k, v in sd.items() if k.startswith("model/")}
    rng = f"rng/rank_{_rank()}.pt"
    read_rng = with_optim and state.get("world_size") == into.layout.world_size and (
        rng in (checksums or {}) or (path / rng).is_file())  # one listed must be there
    try:  # the reader checks the files this rank reads (and its RNG file) against the checksums first
        load_pieces(sd, str(path), storage_reader=CheckedReader(path, checksums, also=(rng,) if read_rng else ()))
    except UsageError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        damage = first_damage(e)
        if damage:
            raise damage from None
        where = _keep_traceback(Path(cfg.log.dir))
        raise UsageError(f"checkpoint {path} is corrupt: loading failed with {first_failure(e)}{where}") from None
    dp.sync_params()  # every rank loaded its owned range: re-assemble the params
    if not with_optim:
        return 0
    step = int(state["step"])
    dp.step_count = int(state.get("optimizer_steps", step))
    for opt in _loaded_optimizers(dp):
        opt.finish_load(state.get("optimizer_scalars", {}))
    if read_rng:
        load_rng_state(path / rng)
    if into.experts is not None:  # re-placed experts: the saved map and load
        into.experts.load(state.get("expert_placement"))
    return step


def _keep_traceback(log_dir: Path) -> str:
    """Rank 0 writes the traceback being handled to ``<log.dir>/error.log``; the note to add to the line."""
    if _rank() == 0:
        try:
            write_atomic(log_dir / ERROR_LOG, traceback.format_exc(), fsync=False)
        except OSError:
            return ""
    return f" (traceback in {log_dir / ERROR_LOG})"
