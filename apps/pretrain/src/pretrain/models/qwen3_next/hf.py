"""Hugging Face Qwen3-Next (``model_type = qwen3_next``, dense MLPs) import/export: config keys and tensor names.

Names are the released ones but for two things: the linear layers' ``linear_attn.conv1d.weight``
(``[C, 1, K]``, channels query | key | value) is kept as ``conv_q``, ``conv_k``, ``conv_v`` (``[C_part, K]``:
each splits over tp in one block), and every zero-centred RMSNorm (the layers' two, the final one,
the full-attention layers' ``q_norm``/``k_norm``) holds ``1 + w`` (the linear layers' gated norm is a
plain one, unchanged).
"""

from __future__ import annotations

import re

import torch

from ...errors import UsageError
from ..hf_fields import hf_value, refuse_unless, rope_from_hf, rope_to_hf
from .pattern import is_full_attention

ZERO_CENTRED = re.compile(r"model\.(norm|layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm))\.weight")
CONV = re.compile(r"(model\.layers\.\d+\.linear_attn\.)conv1d\.weight")


def qwen3_next_model_config(hf: dict, where: str) -> dict:
    refuse_unless(hf, where, "Qwen3-Next", hidden_act="silu", attention_bias=False, attention_dropout=0.0,
                  num_experts=0, mlp_only_layers=[])
    get = lambda key, kind="size", default=...: hf_value(hf, key, kind, where, *(() if default is ... else (default,)))  # noqa: E731
    layers, hidden, heads = get("num_hidden_layers"), get("hidden_size"), get("num_attention_heads")
    rope = dict(hf.get("rope_parameters") or {}) if isinstance(hf.get("rope_parameters"), dict) else hf.get("rope_parameters")
    partial = 0.25 if not isinstance(rope, dict) else rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    theta, scaling = rope_from_hf({**hf, "rope_parameters": rope, "partial_rotary_factor": None}, where)
    types = hf.get("layer_types")
    interval = hf.get("full_attention_interval", 4)
    if types is not None:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        interval = full[0] + 1 if full else layers + 1
        want = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if types != want:
            raise UsageError(f"{where}: layer_types={types!r} is not supported (a full_attention layer every "
                             f"full_attention_interval layers, the rest linear_attention)")
    head_dim = get("head_dim", "size", hidden // heads)
    return dict(vocab_size=get("vocab_size"), hidden=hidden, layers=layers, heads=heads,
                kv_heads=get("num_key_value_heads", "size", heads), ffn_hidden=get("intermediate_size"),
                kv_channels=0 if head_dim * heads == hidden else head_dim, rope_theta=theta, rope_scaling=scaling,
                norm_eps=get("rms_norm_eps", "number", 1e-6), tie_embeddings=get("tie_word_embeddings", "bool", False),
                attention=ATTENTION, full_attention_interval=interval, partial_rotary_factor=float(partial),
                linear_key_heads=get("linear_num_key_heads"), linear_value_heads=get("linear_num_value_heads"),
                linear_key_dim=get("linear_key_head_dim"), linear_value_dim=get("linear_value_head_dim"),
                conv_kernel=get("linear_conv_kernel_dim"))


def qwen3_next_hf_config(m) -> dict:
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": m.vocab_size,
            "hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
            "num_key_value_heads": m.kv_heads, "intermediate_size": m.ffn_hidden, "head_dim": m.head_dim,
            "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "float32", "num_experts": 0,
            "rope_parameters": rope_to_hf(m.rope_theta, m.rope_scaling) | {"partial_rotary_factor": m.partial_rotary_factor},
            "layer_types": ["full_attention" if is_full_attention(m, i) else "linear_attention" for i in range(m.layers)],
            "linear_num_key_heads": m.linear_key_heads, "linear_num_value_heads": m.linear_value_heads,
            "linear_key_head_dim": m.linear_key_dim, "linear_value_head_dim": m.linear_value_dim,
            "linear_conv_kernel_dim": m.conv_kernel, "max_position_embeddings": 4096}


def _conv_widths(m) -> list[int]:
    return [m.linear_key_heads * m.linear_key_dim] * 2 + [m.linear_value_heads * m.linear_value_dim]


def from_qwen3_next_names(state: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Released names -> ours (module docstring). A tensor of the wrong shape is left for the caller to report."""
    out = {}
    for name, t in state.items():
        conv = CONV.fullmatch(name)
        if conv and t.dim() == 3 and t.shape[0] == sum(_conv_widths(m)):
            out |= {f"{conv[1]}conv_{p}": w for p, w in zip("qkv", t[:, 0].split(_conv_widths(m)))}
        elif ZERO_CENTRED.fullmatch(name):
            out[name] = t.float() + 1
        else:
            out[name] = t
    return out


def to_qwen3_next_names(state: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Ours -> the released names (inverse of :func:`from_qwen3_next_names`)."""
    out = {}
    for name, t in state.items():
        if name.endswith(".linear_attn.conv_q"):
            p = name[: -len("conv_q")]
            out[p + "conv1d.weight"] = torch.cat([state[p + "conv_q"], state[p + "conv_k"], state[p + "conv_v"]])[:, None]
        elif name.endswith((".linear_attn.conv_k", ".linear_attn.conv_v")):
            continue
        elif ZERO_CENTRED.fullmatch(name):
            out[name] = t - 1
        else:
            out[name] = t
    return out


ATTENTION = "qwen3_next"
