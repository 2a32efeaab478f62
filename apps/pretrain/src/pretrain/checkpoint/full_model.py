"""A checkpoint's full tensors in one process: every stored tensor read whole, or a model-only checkpoint written from full tensors (Hugging Face import)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import UsageError
from .checked_reader import CheckedReader
from .faults import first_failure
from .integrity import digests, first_damage, read_checksums, write_checksums
from .retention import STATE_FILE
from .safe_metadata import SafeReader
from .store import _quiet, resolve_checkpoint


@_quiet
def read_full_tensors(path: str | Path, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Every stored tensor under ``prefix`` as a full tensor (names without the prefix); any process count."""
    path = resolve_checkpoint(path)
    meta = SafeReader(str(path)).read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
          if k.startswith(prefix) and hasattr(m, "size")}
    try:
        dcp.load(sd, storage_reader=CheckedReader(path, read_checksums(path)))
    except (Exception, CheckpointException) as e:
        raise first_damage(e) or UsageError(f"checkpoint {path} is corrupt: reading it failed with "
                                            f"{first_failure(e)}") from None
    return {k[len(prefix):]: v for k, v in sd.items()}


@_quiet
def save_full_model(path: str | Path, tensors: dict[str, torch.Tensor], state: dict) -> None:
    """Write a model-only checkpoint from full tensors in one process (Hugging Face import)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save({f"model/{k}": v.detach().float().contiguous() for k, v in tensors.items()}, checkpoint_id=str(path),
             no_dist=True)
    (path / STATE_FILE).write_text(json.dumps(state, indent=1))
    write_checksums(path, digests(path, sorted(p.name for p in path.glob("*.distcp"))))
