"""Hugging Face DeepSeek-V3 (``model_type = deepseek_v3``) import/export: config keys and tensor names.

Attention (MLA), norms, dense MLPs, the embedding and the head keep their released names. MoE
layers are renamed: ``mlp.experts.N.{gate,up,down}_proj.weight`` stack into our
``mlp.experts.w_{gate,up,down}`` ``[E, ...]``, ``mlp.gate.weight`` is ``mlp.router.weight``,
``mlp.gate.e_score_correction_bias`` is ``mlp.router.expert_bias``, ``mlp.shared_experts.*_proj``
is ``mlp.shared.w_*``. The multi-token-prediction layers ``model.layers.{L..L+D-1}`` keep their
names; their copies of the shared embedding and head (``embed_tokens``, ``shared_head.head``) are
dropped on import (we share one tensor) and written back on export.
"""

from __future__ import annotations

import re

import torch

from ...errors import UsageError
from ..hf_fields import MISSING, hf_value, refuse_unless, rope_from_hf, rope_to_hf, stack_experts

PROJ = ("gate", "up", "down")


def deepseek_model_config(hf: dict, where: str) -> dict:
    """Our ``[model]`` keys for a DeepSeek-V3 ``config.json`` (bad or unsupported keys: one UsageError line)."""
    refuse_unless(hf, where, "DeepSeek-V3", attention_bias=False, hidden_act="silu", rope_interleave=True,
                  tie_word_embeddings=False, topk_method="noaux_tc", scoring_func="sigmoid")
    theta, scaling = rope_from_hf(hf, where)

    def get(key, kind="size", default=MISSING):
        return hf_value(hf, key, kind, where, default)

    heads = get("num_attention_heads")
    kwargs = dict(
        vocab_size=get("vocab_size"), hidden=get("hidden_size"), layers=get("num_hidden_layers"), heads=heads,
        kv_heads=heads, ffn_hidden=get("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
        norm_eps=get("rms_norm_eps", "number", 1e-6), q_lora_rank=get("q_lora_rank", "count", 0),
        kv_lora_rank=get("kv_lora_rank"), qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"),
        moe_layers_start=get("first_k_dense_replace", "count", 0), num_experts=get("n_routed_experts", "count", 0),
        top_k=get("num_experts_per_tok"), moe_ffn_hidden=get("moe_intermediate_size"),
        shared_experts=get("n_shared_experts", "count", 0), score_func="sigmoid", n_groups=get("n_group", "size", 1),
        topk_groups=get("topk_group", "size", 1), group_score="top2",  # transformers: a group's top-2 sum
        routed_scaling=get("routed_scaling_factor", "number", 1.0), norm_topk_prob=get("norm_topk_prob", "bool", True),
        mtp_depth=get("num_nextn_predict_layers", "count", 0))
    return kwargs


def deepseek_hf_config(m) -> dict:
    if m.n_groups > 1 and m.group_score != "top2":
        raise UsageError(f"export to Hugging Face: group_score={m.group_score!r}; DeepSeek-V3 in transformers scores "
                         f"a group by its top 2 (group_score='top2')")
    scaling = m.rope_scaling
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": m.vocab_size,
            "hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
            "num_key_value_heads": m.heads, "intermediate_size": m.ffn_hidden, "rms_norm_eps": m.norm_eps,
            "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
            "first_k_dense_replace": m.moe_layers_start if m.num_experts else m.layers,
            "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.expert_ffn_hidden,
            "n_shared_experts": m.shared_experts, "n_group": m.n_groups, "topk_group": m.topk_groups,
            "routed_scaling_factor": m.routed_scaling, "norm_topk_prob": m.normalize_topk,
            "num_nextn_predict_layers": m.mtp_depth, "rope_interleave": True, "attention_bias": False,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
            "rope_parameters": rope_to_hf(m.rope_theta, scaling),
            "max_position_embeddings": max(4096, int(scaling.get("original_max_position_embeddings", 0)
                                                     * scaling.get("factor", 1)))}


def _moe_layers(m):
    return [i for i in range(m.layers + m.mtp_depth) if m.is_moe_layer(i)]


def from_deepseek_names(state: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Released names -> ours (stacked experts, router). Missing tensors are left for the caller to report."""
    out = dict(state)
    for j in range(m.layers, m.layers + m.mtp_depth):  # MTP's copies of the shared tensors
        out.pop(f"model.layers.{j}.embed_tokens.weight", None)
        out.pop(f"model.layers.{j}.shared_head.head.weight", None)
    for i in _moe_layers(m):
        p = f"model.layers.{i}.mlp."
        stack_experts(out, p, m.num_experts, {w: f"{w}_proj" for w in PROJ})
        for w in PROJ:
            if f"{p}shared_experts.{w}_proj.weight" in out:
                out[f"{p}shared.w_{w}"] = out.pop(f"{p}shared_experts.{w}_proj.weight")
        for theirs, ours in (("gate.weight", "router.weight"), ("gate.e_score_correction_bias", "router.expert_bias")):
            if p + theirs in out:
                out[p + ours] = out.pop(p + theirs)
    return out


def to_deepseek_names(state: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Ours -> the released names (inverse of :func:`from_deepseek_names`)."""
    out = {}
    for name, t in state.items():
        hit = re.fullmatch(r"(model\.layers\.\d+\.mlp\.)(experts\.w_|shared\.w_|router\.)(\w+)", name)
        if not hit:
            out[name] = t
        elif hit[2] == "experts.w_":
            out |= {f"{hit[1]}experts.{e}.{hit[3]}_proj.weight": t[e] for e in range(t.shape[0])}
        elif hit[2] == "shared.w_":
            out[f"{hit[1]}shared_experts.{hit[3]}_proj.weight"] = t
        else:
            out[hit[1] + {"weight": "gate.weight", "expert_bias": "gate.e_score_correction_bias"}[hit[3]]] = t
    for j in range(m.layers, m.layers + m.mtp_depth):
        out[f"model.layers.{j}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        out[f"model.layers.{j}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    return out
