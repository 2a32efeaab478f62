"""Hugging Face import/export: config.json + safetensors (never pickle) <-> our checkpoints.

Llama: our full state dict already uses HF names and HF's rotate-half RoPE convention, so weights
copy over unchanged; only the config keys are translated. DeepSeek-V3: see hf_deepseek.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from ..config import Config, ModelConfig
from ..errors import UsageError
from ..model.reference import full_shapes
from .hf_deepseek import deepseek_hf_config, deepseek_model_config, from_deepseek_names, to_deepseek_names
from .store import FORMAT, STATE_FILE, read_full_tensors, read_state, resolve_checkpoint, save_full_model

# HF config.json key -> [model] key
HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden", "num_hidden_layers": "layers",
           "num_attention_heads": "heads", "num_key_value_heads": "kv_heads", "intermediate_size": "ffn_hidden",
           "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings"}


INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "head_dim")


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    kind = hf.get("model_type")
    if kind == "deepseek_v3":
        try:
            return deepseek_model_config(hf, where)
        except KeyError as e:
            raise UsageError(f"{where}: missing {e.args[0]}") from None
    if kind not in ("llama", "mistral", None):
        raise UsageError(f"{where}: model_type={kind!r} is not supported (llama, mistral or deepseek_v3)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UsageError(f"{where}: {key}=true is not supported (the model has no biases)")
    rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 keeps rope_theta in here
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise UsageError(f"{where}: RoPE scaling ({hf.get('rope_scaling') or rope!r}) is not supported (plain RoPE only)")
    if "rope_theta" in rope:
        hf = hf | {"rope_theta": rope["rope_theta"]}
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (SwiGLU with silu)")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
               if k not in hf]
    if missing:
        raise UsageError(f"{where}: missing {', '.join(missing)}")
    wrong = [f"{k}={hf[k]!r}" for k in INT_KEYS if k in hf and (type(hf[k]) is not int or hf[k] < 1)]
    wrong += [f"{k}={hf[k]!r}" for k in ("rope_theta", "rms_norm_eps")
              if k in hf and (type(hf[k]) not in (int, float) or hf[k] <= 0)]
    if wrong:
        raise UsageError(f"{where}: {', '.join(wrong)}: sizes must be positive integers, rope_theta and "
                         f"rms_norm_eps positive numbers")
    kwargs = {ours: hf[k] for k, ours in HF_KEYS.items() if k in hf}
    kwargs.setdefault("kv_heads", hf["num_attention_heads"])
    if "head_dim" in hf and hf["head_dim"] != hf["hidden_size"] // hf["num_attention_heads"]:
        raise UsageError(f"{where}: head_dim={hf['head_dim']} != hidden_size/num_attention_heads is not supported")
    try:
        return ModelConfig(**kwargs)
    except (UsageError, TypeError) as e:
        raise UsageError(f"{where}: {e}") from None


def hf_config_from_model(m: ModelConfig) -> dict:
    if m.attention == "mla":
        return deepseek_hf_config(m)
    if m.num_experts:
        raise UsageError("export to Hugging Face supports dense Llama and DeepSeek-V3 (MLA) models only "
                         "(this one has MoE layers with attention='gqa')")
    out = {hf: getattr(m, ours) for hf, ours in HF_KEYS.items()}
    return out | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                  "head_dim": m.head_dim, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
                  "max_position_embeddings": 2048,
                  "rope_parameters": {"rope_theta": m.rope_theta, "rope_type": "default"}}


def read_hf(src: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full state dict) of a ``save_pretrained`` directory."""
    from safetensors.torch import load_file

    src = Path(src)
    if not (src / "config.json").is_file():
        raise UsageError(f"{src} has no config.json (expected a Hugging Face save_pretrained directory)")
    try:
        hf = json.loads((src / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{src / 'config.json'} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{src / 'config.json'} is not a JSON object")
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
    if m.attention == "mla":
        if m.mtp_depth and not any(k.startswith(f"model.layers.{m.layers}.") for k in state):
            m = replace(m, mtp_depth=0)  # transformers saves no MTP layers: import the main model alone
        state = from_deepseek_names(state, m)
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


def import_hf(src: str | Path, out: str | Path) -> Path:
    """Write a model-only checkpoint at ``out`` and ``out/config.toml`` (training starts from it)."""
    out = Path(out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} already exists and is not empty; choose a new directory (nothing is overwritten)")
    m, state = read_hf(src)
    from ..config import CheckpointConfig, LogConfig

    cfg = Config(model=m, checkpoint=CheckpointConfig(init_from=str(out)), log=LogConfig(dir=f"runs/{out.name}"))
    save_full_model(out, state, {"format": FORMAT, "step": 0, "config": cfg.to_dict(), "optimizer": False,
                                 "source": f"huggingface:{Path(src).resolve()}"})
    (out / "config.toml").write_text(f"# derived from {Path(src).resolve()} by pretrain convert --from-hf\n"
                                     + cfg.to_toml())
    return out


def export_hf(checkpoint: str | Path, dst: str | Path) -> Path:
    """Write ``dst/config.json`` and ``dst/model.safetensors`` from one of our checkpoints."""
    from safetensors.torch import save_file

    path = resolve_checkpoint(checkpoint)
    saved = read_state(path)
    try:
        m = ModelConfig(**saved["config"]["model"])
    except (KeyError, TypeError) as e:
        raise UsageError(f"checkpoint {path}: {STATE_FILE} has no valid model config ({e})") from None
    state = read_full_tensors(path)
    hf = hf_config_from_model(m)
    if m.attention == "mla":
        state = to_deepseek_names(state, m)
    if m.tie_embeddings:
        state.pop("lm_head.weight", None)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(hf, indent=1))
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(dst, saved["config"].get("data", {}))
    return dst


def write_tokenizer(dst: Path, data: dict) -> None:
    """The tokenizer the run's data was prepared with, beside the weights: the byte tokenizer as a
    ``tokenizer.json``, or a copy of the ``tokenizers`` file (nothing when that file is gone)."""
    name = data.get("tokenizer", "byte")
    header = Path(f"{data['path']}.json") if data.get("path") else None
    if header is not None and header.is_file():
        name = json.loads(header.read_text()).get("tokenizer", name)  # what `prepare` used
    if name in ("", "byte"):
        from ..data.tokenizer import ByteTokenizer

        tok = ByteTokenizer()
        (dst / "tokenizer.json").write_text(json.dumps(tok.to_json(), ensure_ascii=False))
        special = {"eos_token": tok.eos_token}
    elif Path(name).is_file():
        shutil.copyfile(name, dst / "tokenizer.json")
        special = {}
    else:
        return
    (dst / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}))
