"""Whether a checkpoint fits the run that loads it: the model's shapes and the optimizer whose state it holds.

Checked before any tensor is read (``pretrain train``'s pre-flight and the load itself), each a
one-line :class:`~pretrain.errors.UsageError` naming the key or tensor and both values.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from .safe_metadata import SafeReader

# [model] keys that change tensor shapes or their meaning: a checkpoint must agree on them
SHAPE_KEYS = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "moe_layers_start", "num_experts",
              "moe_ffn_hidden", "shared_experts", "tie_embeddings", "kv_channels", "qk_norm", "decoder_sparse_step")


def check_compatible(path: Path, state: dict, cfg) -> None:
    """UsageError naming every [model] key whose value differs between the checkpoint and ``cfg``."""
    saved = state.get("config", {}).get("model", {})
    diffs = [f"[model].{k}: checkpoint {saved.get(k)!r}, config {getattr(cfg.model, k)!r}"
             for k in SHAPE_KEYS if k in saved and saved[k] != getattr(cfg.model, k)]
    if diffs:
        raise UsageError(f"checkpoint {path} does not match the model: " + "; ".join(diffs))


def check_optimizer_matches(path: Path, state: dict, cfg) -> None:
    """Resuming needs the optimizer whose state the checkpoint holds (one without the key holds AdamW's)."""
    saved = state.get("optimizer_name", "adamw")
    if saved != cfg.train.optimizer:
        raise UsageError(f"checkpoint {path} holds the state of [train].optimizer={saved!r}, the config says "
                         f"{cfg.train.optimizer!r}: set it back, or start from its weights with [checkpoint].init_from")


def check_stored_shapes(path: Path, wanted: dict) -> set[str]:
    """Compare the stored tensors' shapes with what we need; returns the stored keys."""
    meta = SafeReader(str(path)).read_metadata()  # a missing, truncated or crafted .metadata: UsageError
    stored = meta.state_dict_metadata
    for key, st in wanted.items():
        if key.startswith("optim/") and key not in stored:
            continue  # a model-only checkpoint (e.g. converted from Hugging Face)
        if key not in stored:
            raise UsageError(f"checkpoint {path} lacks tensor {key}")
        have = tuple(stored[key].size)
        if have != tuple(st.full_shape):
            raise UsageError(f"checkpoint {path}: {key} has shape {list(have)}, the model needs {list(st.full_shape)}")
    return set(stored)
