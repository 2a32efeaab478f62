"""Distributed checkpoints that load under any layout.

A checkpoint directory ``DIR/step_N`` holds, written with torch.distributed.checkpoint (DCP):

- ``model/<hf name>``: every tensor of the FULL model (Hugging Face names), and
- ``optim/exp_avg/<hf name>``, ``optim/exp_avg_sq/<hf name>``: AdamW's moments in the same shape,

each rank contributing the block it holds (its tp / ep / etp slice; the DP shards are gathered
first), and DCP writing every block once. Loading under another layout reads the blocks the new
ranks need and cuts them with the same code as initialisation (see :mod:`.shards`).
``trainer_state.json`` (step, format, config, layout) and ``rng/rank_R.pt`` (RNG states, read
back with ``weights_only=True``) complete it.

Crash safety: everything is written to ``step_N.tmp``, renamed to ``step_N`` once all ranks have
finished, and only then is the ``latest`` marker replaced (atomically); the last ``keep`` are kept.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from ..errors import UsageError
from .faults import injected_kill, removed_if_disk_full
from .retention import LATEST, STATE_FILE, publish, run_id_of
from .safe_metadata import SafeReader
from .shards import ShardSpec

FORMAT = "pretrain-checkpoint-v1"
MOMENTS = ("exp_avg", "exp_avg_sq")
# [model] keys that change tensor shapes or their meaning: a checkpoint must agree on them
SHAPE_KEYS = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "moe_layers_start", "num_experts",
              "moe_ffn_hidden", "shared_experts", "tie_embeddings")


def _quiet(fn):
    """DCP still reads and writes ShardedTensor blocks; its deprecation warning is noise here."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*", category=UserWarning)
            return fn(*args, **kwargs)

    return wrapper


def _complement(offsets, sizes, shape) -> list[tuple[list[int], list[int]]]:
    """Non-overlapping boxes covering ``shape`` minus the box (offsets, sizes)."""
    boxes = []
    lo, hi = [0] * len(shape), list(shape)  # the slab still to split, narrowed dim by dim
    for d in range(len(shape)):
        for a, b in ((0, offsets[d]), (offsets[d] + sizes[d], shape[d])):
            if b > a:
                o, z = list(lo), [h - l for l, h in zip(lo, hi)]
                o[d], z[d] = a, b - a
                boxes.append((o, z))
        lo[d], hi[d] = offsets[d], offsets[d] + sizes[d]
    return boxes


def _block(spec: ShardSpec, tensor: torch.Tensor) -> ShardedTensor:
    """This rank's block of one full tensor, as DCP understands it (only its own chunk is described)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    md = ShardMetadata(list(spec.offsets), list(spec.sizes), f"rank:{rank}/cpu")
    # ShardedTensor insists its metadata tiles the whole tensor; DCP only reads the local shards, so
    # the rest is described as blocks "elsewhere" (their placement does not matter)
    elsewhere = f"rank:{(rank + 1) % world}/cpu"
    others = [ShardMetadata(o, z, elsewhere) for o, z in _complement(spec.offsets, spec.sizes, spec.full_shape)]
    props = TensorProperties(dtype=torch.float32, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata([md] + others, torch.Size(spec.full_shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(tensor, md)], meta)


def _local_values(trainer, kind: str, copy: bool = False) -> dict[str, torch.Tensor]:
    """This rank's full local tensors (DP shards gathered) of ``kind``: 'master' (the model) or a moment.

    ``copy``: tensors never shared with the live model (on CPU, ``.cpu()`` would alias it), for a
    background write that runs while training goes on."""
    def cpu(t):
        return t.detach().to("cpu", torch.float32, copy=copy)

    dp = trainer.model.dp
    trained = {k: cpu(v) for k, v in dp.full_state(kind).items()}
    if kind != "master":
        return trained
    buffers = trainer.model.module.state_dict()
    return {n: trained[n] if n in trained else cpu(buffers[n]) for n in trainer.model.shard_specs}


def _checkpoint_dict(trainer, with_optim: bool, copy: bool = False) -> dict:
    specs = trainer.model.shard_specs
    out = {}
    master = _local_values(trainer, "master", copy)
    for n, spec in specs.items():
        out[f"model/{spec.full_name}"] = _block(spec, master[n].contiguous())
    if with_optim:
        trained = set(trainer.model.dp.param_names.values())
        for kind in MOMENTS:
            values = _local_values(trainer, kind, copy)
            for n, spec in specs.items():
                if n in trained:
                    out[f"optim/{kind}/{spec.full_name}"] = _block(spec, values[n].contiguous())
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def trainer_state(trainer, step: int) -> dict:
    layout = trainer.layout
    return {"format": FORMAT, "step": step, "config": trainer.cfg.to_dict(), "world_size": layout.world_size,
            "layout": {k: getattr(layout, k) for k in ("tp", "cp", "pp", "dp", "ep", "etp", "vpp")},
            "zero": trainer.cfg.parallel.zero, "optimizer": True, "optimizer_steps": trainer.model.dp.step_count}


def _prepare(root: Path, step: int) -> tuple[Path, Path]:
    """(final, tmp) paths of the save of ``step``; rank 0 makes an empty ``tmp`` before any rank writes."""
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        with removed_if_disk_full(tmp):
            (tmp / "rng").mkdir(parents=True)
    _barrier()
    return final, tmp


def _finalise(root: Path, tmp: Path, final: Path, state: dict, keep: int) -> None:
    """Rank 0, once every rank's files are in ``tmp``: state file (with the run's id), rename, ``latest``, prune."""
    (tmp / STATE_FILE).write_text(json.dumps(state | {"run_id": run_id_of(root)}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    publish(root, final, keep)


@_quiet
def save_checkpoint(trainer, root: str | Path, step: int, keep: int = 2, fail_before_rename: bool = False) -> Path:
    """Write ``root/step_<step>`` (all ranks call it); returns its path. ``fail_before_rename`` is for tests."""
    root = Path(root)
    final, tmp = _prepare(root, step)
    sd = _checkpoint_dict(trainer, with_optim=True)
    with removed_if_disk_full(tmp):
        dcp.save(sd, checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
        injected_kill(_rank(), step)
        _barrier()
        if fail_before_rename:
            raise RuntimeError(f"injected failure while saving step {step} (before the rename)")
        if _rank() == 0:
            _finalise(root, tmp, final, trainer_state(trainer, step), keep)
    _barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint the ``latest`` marker of ``root`` names (None if there is none)."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise UsageError(f"checkpoint marker {marker} names {path.name}, which is missing or incomplete")
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


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"checkpoint {path}: cannot read {STATE_FILE}: {e}") from None
    if state.get("format") != FORMAT:
        raise UsageError(f"checkpoint {path}: format {state.get('format')!r} is not {FORMAT!r}")
    return state


def check_compatible(path: Path, state: dict, cfg) -> None:
    """UsageError naming every [model] key whose value differs between the checkpoint and ``cfg``."""
    saved = state.get("config", {}).get("model", {})
    diffs = [f"[model].{k}: checkpoint {saved.get(k)!r}, config {getattr(cfg.model, k)!r}"
             for k in SHAPE_KEYS if k in saved and saved[k] != getattr(cfg.model, k)]
    if diffs:
        raise UsageError(f"checkpoint {path} does not match the model: " + "; ".join(diffs))


def _check_metadata(path: Path, wanted: dict) -> set[str]:
    """Compare the stored tensors' shapes with what we need; returns the stored keys."""
    meta = SafeReader(str(path)).read_metadata()  # a missing, truncated or crafted .metadata: UsageError
    stored = meta.state_dict_metadata
    for key, st in wanted.items():
        if key.startswith("optim/") and key not in stored:
            continue  # a model-only checkpoint (e.g. converted from Hugging Face)
        if key not in stored:
            raise UsageError(f"checkpoint {path} lacks tensor {key}")
        have = tuple(stored[key].size)
        if have != tuple(st.size()):
            raise UsageError(f"checkpoint {path}: {key} has shape {list(have)}, the model needs {list(st.size())}")
    return set(stored)


@_quiet
@torch.no_grad()
def load_checkpoint(trainer, path: str | Path, model_only: bool = False) -> int:
    """Load a checkpoint saved under any layout into ``trainer``; returns the step to continue from.

    ``model_only`` (or a checkpoint without optimizer state) keeps fresh moments and starts at step 0."""
    path = resolve_checkpoint(path)
    state = read_state(path)
    check_compatible(path, state, trainer.cfg)
    specs = trainer.model.shard_specs
    sd = {}
    for n, spec in specs.items():
        sd[f"model/{spec.full_name}"] = _block(spec, torch.zeros(spec.sizes))
    trained = set(trainer.model.dp.param_names.values())
    for kind in MOMENTS:
        for n, spec in specs.items():
            if n in trained:
                sd[f"optim/{kind}/{spec.full_name}"] = _block(spec, torch.zeros(spec.sizes))
    stored = _check_metadata(path, sd)
    with_optim = state.get("optimizer", False) and not model_only and all(k in stored for k in sd)
    if not with_optim:
        sd = {k: v for k, v in sd.items() if k.startswith("model/")}
    try:
        dcp.load(sd, storage_reader=SafeReader(str(path)))
    except UsageError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise UsageError(f"checkpoint {path} is corrupt: loading failed with {type(e).__name__}: {e}") from None

    def values(prefix):
        return {n: sd[f"{prefix}/{spec.full_name}"].local_shards()[0].tensor for n, spec in specs.items()
                if f"{prefix}/{spec.full_name}" in sd}

    dp, module = trainer.model.dp, trainer.model.module
    model = values("model")
    dp.load_full_state("master", {n: t for n, t in model.items() if n in trained})
    local = module.state_dict(keep_vars=True)
    for n, t in model.items():
        if n not in trained:
            local[n].data.copy_(t)
    if not with_optim:
        return 0
    for kind in MOMENTS:
        dp.load_full_state(kind, values(f"optim/{kind}"))
    step = int(state["step"])
    dp.step_count = int(state.get("optimizer_steps", step))
    if state.get("world_size") == trainer.layout.world_size:
        rng = path / "rng" / f"rank_{_rank()}.pt"
        if rng.is_file():
            set_rng_state(torch.load(rng, weights_only=True))
    return step


def rng_state() -> dict:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@_quiet
def read_full_tensors(path: str | Path, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Every stored tensor under ``prefix`` as a full tensor (names without the prefix); any process count."""
    path = resolve_checkpoint(path)
    meta = SafeReader(str(path)).read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
          if k.startswith(prefix) and hasattr(m, "size")}
    try:
        dcp.load(sd, storage_reader=SafeReader(str(path)))
    except (Exception, CheckpointException) as e:
        raise UsageError(f"checkpoint {path} is corrupt: reading it failed with {type(e).__name__}: {e}") from None
    return {k[len(prefix):]: v for k, v in sd.items()}


@_quiet
def save_full_model(path: str | Path, tensors: dict[str, torch.Tensor], state: dict) -> None:
    """Write a model-only checkpoint from full tensors in one process (Hugging Face import)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save({f"model/{k}": v.detach().float().contiguous() for k, v in tensors.items()}, checkpoint_id=str(path),
             no_dist=True)
    (path / STATE_FILE).write_text(json.dumps(state, indent=1))
