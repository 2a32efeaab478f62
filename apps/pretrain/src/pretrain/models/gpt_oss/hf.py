"""transformers' ``gpt_oss``: config keys both ways, and the MoE tensors.

Attention (with its biases and ``sinks``), norms, embedding and head keep their names. MoE: the
router's ``mlp.router.weight`` / ``bias`` keep theirs (our selection-only ``router.expert_bias``, zero,
is not written back); ``mlp.experts.gate_up_proj [E, H, 2F]`` holds gate and up interleaved (gate in
the even columns) and ``down_proj [E, F, H]`` is transposed to ours, their biases likewise.
"""

from __future__ import annotations

import re

import torch

from ..hf_fields import hf_value, refuse_unless, rope_from_hf, rope_to_hf
from ...errors import UsageError
from .attention import SLIDING_WINDOW, window_of
from .moe import ALPHA, LIMIT

ARCHITECTURE = "GptOssForCausalLM"


def layer_types(layers: int) -> list[str]:
    return ["sliding_attention" if window_of(i) else "full_attention" for i in range(layers)]


def gpt_oss_model_config(hf: dict, where: str) -> dict:
    layers = hf_value(hf, "num_hidden_layers", "size", where)
    refuse_unless(hf, where, "model_type='gpt_oss'", attention_bias=True, attention_dropout=0.0,
                  sliding_window=SLIDING_WINDOW, swiglu_limit=LIMIT, swiglu_alpha=ALPHA, hidden_act="silu",
                  layer_types=layer_types(layers))
    hidden, heads = hf_value(hf, "hidden_size", "size", where), hf_value(hf, "num_attention_heads", "size", where)
    head_dim = hf_value(hf, "head_dim", "size", where, hidden // heads)
    theta, scaling = rope_from_hf(hf, where)
    top_k, aux = hf_value(hf, "num_experts_per_tok", "size", where), hf_value(hf, "router_aux_loss_coef", "coeff", where, 0.0)
    ffn = hf_value(hf, "intermediate_size", "size", where)
    return dict(attention="gpt_oss", vocab_size=hf_value(hf, "vocab_size", "size", where), hidden=hidden, layers=layers,
                heads=heads, kv_heads=hf_value(hf, "num_key_value_heads", "size", where, heads), ffn_hidden=ffn,
                moe_ffn_hidden=ffn, kv_channels=0 if head_dim * heads == hidden else head_dim,
                rope_theta=theta, rope_scaling=scaling, norm_eps=hf_value(hf, "rms_norm_eps", "number", where, 1e-5),
                tie_embeddings=hf_value(hf, "tie_word_embeddings", "bool", where, False),
                num_experts=hf_value(hf, "num_local_experts", "size", where), top_k=top_k, score_func="softmax",
                norm_topk_prob=True,
                aux_loss_coeff=top_k * aux if hf_value(hf, "output_router_logits", "bool", where, False) else 0.0)


def gpt_oss_hf_config(m) -> dict:
    return {"architectures": [ARCHITECTURE], "model_type": "gpt_oss", "vocab_size": m.vocab_size, "hidden_size": m.hidden,
            "num_hidden_layers": m.layers, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
            "head_dim": m.head_dim, "intermediate_size": m.expert_ffn_hidden, "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k, "sliding_window": SLIDING_WINDOW, "layer_types": layer_types(m.layers),
            "attention_bias": True, "attention_dropout": 0.0, "swiglu_limit": LIMIT, "swiglu_alpha": ALPHA,
            "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu",
            "router_aux_loss_coef": m.aux_loss_coeff / m.top_k, "output_router_logits": m.aux_loss_coeff > 0,
            "rope_parameters": rope_to_hf(m.rope_theta, m.rope_scaling), "torch_dtype": "float32",
            "max_position_embeddings": max(4096, m.rope_scaling.get("original_max_position_embeddings", 0)
                                           * int(m.rope_scaling.get("factor", 1)))}


def from_gpt_oss_names(state: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Released names -> ours. Missing tensors are left for the caller to report."""
    out = dict(state)
    for i in range(m.layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" in out:
            gate_up = out.pop(p + "gate_up_proj")
            out[p + "w_gate"], out[p + "w_up"] = (gate_up[..., j::2].transpose(1, 2).contiguous() for j in (0, 1))
        if p + "gate_up_proj_bias" in out:
            bias = out.pop(p + "gate_up_proj_bias")
            out[p + "b_gate"], out[p + "b_up"] = bias[..., 0::2].contiguous(), bias[..., 1::2].contiguous()
        if p + "down_proj" in out:
            out[p + "w_down"] = out.pop(p + "down_proj").transpose(1, 2).contiguous()
        if p + "down_proj_bias" in out:
            out[p + "b_down"] = out.pop(p + "down_proj_bias")
        out[f"model.layers.{i}.mlp.router.expert_bias"] = torch.zeros(m.num_experts)
    return out


def to_gpt_oss_names(state: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Ours -> the released names (inverse of :func:`from_gpt_oss_names`)."""
    out, pairs = {}, {}
    for name, t in state.items():
        hit = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts\.)(w|b)_(gate|up|down)", name)
        if name.endswith("mlp.router.expert_bias"):
            if t.any():
                raise UsageError(f"export to Hugging Face: {name} is not zero ([model].bias_update_rate moved it) and "
                                 f"{ARCHITECTURE} has no such bias")
        elif hit is None:
            out[name] = t
        elif hit[3] == "down":
            out[hit[1] + ("down_proj" if hit[2] == "w" else "down_proj_bias")] = t.transpose(1, 2) if hit[2] == "w" else t
        else:
            pairs.setdefault((hit[1], hit[2]), {})[hit[3]] = t.transpose(1, 2) if hit[2] == "w" else t
    for (prefix, kind), two in pairs.items():
        out[prefix + ("gate_up_proj" if kind == "w" else "gate_up_proj_bias")] = torch.stack(
            [two["gate"], two["up"]], dim=-1).flatten(-2)  # interleaved: gate, up, gate, up ...
    return out
