"""Hugging Face import/export: config.json + safetensors (never pickle) <-> our checkpoints.

Our full state dict uses HF names where it can; each model family (``pretrain.models``) says which
``model_type`` values it reads and writes, its config keys and its tensor renames both ways
(Llama, Qwen3: none; Qwen3-MoE and Mixtral: stacked experts; ``models/gqa/hf.py``, ``models/deepseek/hf.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..config import Config, ModelConfig, config_from_dict
from ..errors import UsageError
from ..model.shapes import full_shapes
from ..models import FAMILIES, family_for_hf, family_of
from ..models.hf_fields import read_config_json
from .hf_data import source_tokenizer
from .hf_tokenizer import check_tokenizer, write_tokenizer
from .full_model import read_full_tensors, save_full_model
from .store import FORMAT, STATE_FILE, read_state, resolve_checkpoint

SUPPORTED = ", ".join(sorted(kind for f in FAMILIES for kind in f.hf_architectures))
DEFAULT_MODEL_TYPE = "llama"  # a config.json without model_type


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Our ``[model]`` for a transformers ``config.json``; what we do not implement is one error line."""
    kind = hf.get("model_type")
    family = family_for_hf(DEFAULT_MODEL_TYPE if kind is None else kind)
    if family is None:
        raise UsageError(f"{where}: model_type={kind!r} is not supported ({SUPPORTED})")
    arch = hf.get("architectures") or []
    known = {a for f in FAMILIES for a in f.hf_architectures.values()}
    if not isinstance(arch, list) or any(a not in known for a in arch):
        raise UsageError(f"{where}: architectures={arch!r} is not supported (one of {', '.join(sorted(known))})")
    try:
        return ModelConfig(**family.model_config_from_hf(hf, where))
    except (UsageError, TypeError) as e:
        raise UsageError(f"{where}: {e}") from None


def hf_config_from_model(m: ModelConfig) -> dict:
    return family_of(m).hf_config(m)


def read_hf(src: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full state dict) of a ``save_pretrained`` directory."""
    from safetensors.torch import load_file

    src = Path(src)
    if not (src / "config.json").is_file():
        raise UsageError(f"{src} has no config.json (expected a Hugging Face save_pretrained directory)")
    hf = read_config_json(src / "config.json")
    m = model_config_from_hf(hf, str(src / "config.json"))
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{src} has no *.safetensors files (pickled .bin weights are not read, for safety)")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error type on a malformed header
            raise UsageError(f"{f} is not a valid safetensors file ({e})") from None
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    m, state = family_of(m).from_hf_names(state, m, hf)
    if (m.tie_embeddings or "lm_head.weight" not in state) and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    shapes = full_shapes(m)
    problems = [f"{k}: missing" for k in shapes if k not in state]
    problems += [f"{k}: unexpected" for k in state if k not in shapes]
    problems += [f"{k}: shape {list(state[k].shape)}, config implies {list(shapes[k])}"
                 for k in shapes if k in state and tuple(state[k].shape) != tuple(shapes[k])]
    if problems:
        raise UsageError(f"{src}: weights do not match config.json: " + "; ".join(problems[:5]))
    return m, {k: state[k].to(torch.float32) for k in shapes}


def _refuse_existing(path: Path, option: str) -> None:
    """Before anything is read: ``path`` is new (under a directory) or an empty directory, not a symlink."""
    if path.is_symlink():
        raise UsageError(f"{option} {path} is a symlink; choose a new directory (nothing is written through a symlink)")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UsageError(f"{option} {path} already exists and is not empty; choose a new directory "
                         f"(nothing is overwritten)")
    above = next((p for p in Path(os.path.abspath(path)).parents if os.path.lexists(p)), None)
    if above is not None and not above.is_dir():
        raise UsageError(f"{option} {path}: {above} is not a directory; choose a new directory")


def _make_dir(path: Path, option: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only mount, no permission, a name taken since the check
        raise UsageError(f"{option} {path} cannot be created ({e.strerror or e}); choose a writable directory") from None


def import_hf(src: str | Path, out: str | Path) -> Path:
    """Write a model-only checkpoint at ``out`` and ``out/config.toml`` (training starts from it)."""
    _refuse_existing(Path(out), "--out")  # a symlink there would be followed by resolve()
    out = Path(out).resolve()
    m, state = read_hf(src)
    from ..config import CheckpointConfig, DataConfig, LogConfig

    tokenizer = source_tokenizer(Path(src))  # training refuses data of another tokenizer (hf_data.py)
    cfg = Config(model=m, checkpoint=CheckpointConfig(init_from=str(out)), log=LogConfig(dir=f"runs/{out.name}"),
                 data=DataConfig(tokenizer=tokenizer.get("tokenizer", "byte")))
    save_full_model(out, state, {"format": FORMAT, "step": 0, "config": cfg.to_dict(), "optimizer": False,
                                 "source": f"huggingface:{Path(src).resolve()}", **tokenizer})
    (out / "config.toml").write_text(f"# derived from {Path(src).resolve()} by pretrain convert --from-hf\n"
                                     + cfg.to_toml())
    return out


def export_hf(checkpoint: str | Path, dst: str | Path, tokenizer: bool = True) -> tuple[Path, list[str]]:
    """Write ``dst/config.json``, ``dst/model.safetensors`` and (``tokenizer``) the data's tokenizer from
    one of our checkpoints; (dst, the names of the files written)."""
    from safetensors.torch import save_file

    dst = Path(dst)
    _refuse_existing(dst, "--to-hf")
    path = resolve_checkpoint(checkpoint)
    saved = read_state(path)
    try:
        m = config_from_dict({"model": saved["config"]["model"]}).model  # type-checked as a TOML's
    except (KeyError, TypeError, UsageError) as e:
        raise UsageError(f"checkpoint {path}: {STATE_FILE} has no valid model config ({e})") from None
    data = saved["config"].get("data", {})
    if tokenizer:
        check_tokenizer(data)  # before any write: only a tokenizer `prepare` recorded is copied
    state = read_full_tensors(path)
    hf = hf_config_from_model(m)
    state = family_of(m).to_hf_names(state, m)
    if m.tie_embeddings:
        state.pop("lm_head.weight", None)
    _make_dir(dst, "--to-hf")
    (dst / "config.json").write_text(json.dumps(hf, indent=1))
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    # safetensors writes mode 0600: give it the mode config.json got (0666 less the umask)
    (dst / "model.safetensors").chmod((dst / "config.json").stat().st_mode & 0o777)
    return dst, ["config.json", "model.safetensors", *(write_tokenizer(dst, data) if tokenizer else [])]
