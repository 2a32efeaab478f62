"""Hugging Face grouped-query-attention families: Llama (and Mistral without a sliding window), Qwen3,
Qwen3-MoE and Mixtral. Config keys both ways, and the MoE tensor names.

Attention, norms, dense MLPs, the embedding and the head keep their names in our full state dict
(Qwen3's ``self_attn.q_norm`` / ``k_norm`` too). MoE layers: Qwen3-MoE's ``mlp.gate.weight`` /
``mlp.experts.N.{gate,up,down}_proj.weight`` and Mixtral's ``block_sparse_moe.gate.weight`` /
``block_sparse_moe.experts.N.{w1,w3,w2}.weight`` become our ``mlp.router.weight`` and stacked
``mlp.experts.w_{gate,up,down}``; our selection-only ``router.expert_bias`` (zero: these routers
have none) is not written back.

Router: softmax over the experts, top ``num_experts_per_tok``, weights renormalized when
``norm_topk_prob`` (Mixtral: always). Balancing loss: transformers adds
``router_aux_loss_coef * E * sum_e f_e P_e`` (``f_e`` the fraction of routed slots, not divided
by top_k) only with ``output_router_logits``; ours with ``aux_loss_coeff = top_k * router_aux_loss_coef``
is the same for one MoE layer; over several layers transformers pools the counts of all layers
before multiplying, ours sums each layer's loss (as Megatron), so it is imported as that sum.
"""

from __future__ import annotations

import torch

from ...errors import UsageError
from ..hf_fields import hf_value, refuse_unless, rope_from_hf, rope_to_hf, stack_experts, unstack_experts

MOE_BLOCK = {"qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
             "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})}


def gqa_model_config(hf: dict, where: str) -> dict:
    """Our ``[model]`` keys for a ``config.json`` of one of the family's model types (unsupported keys: one error line)."""
    kind = hf.get("model_type") or "llama"
    family = f"model_type={kind!r}"
    for key in ("attention_bias", "mlp_bias"):
        if hf_value(hf, key, "bool", where, False):
            raise UsageError(f"{where}: {key}=true is not supported (projections without biases only)")
    refuse_unless(hf, where, family, hidden_act="silu", router_jitter_noise=0.0, use_sliding_window=False,
                  attention_dropout=0.0)
    if kind in ("mistral", "mixtral") and hf.get("sliding_window") is not None:
        raise UsageError(f"{where}: sliding_window={hf['sliding_window']!r} is not supported (full causal attention "
                         f"only; null turns it off)")
    types = hf.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise UsageError(f"{where}: layer_types={types!r} must be a list of layer type names, e.g. [\"full_attention\"]")
    if any(t != "full_attention" for t in types or []):
        raise UsageError(f"{where}: layer_types={hf['layer_types']!r} is not supported (full_attention only)")
    hidden, heads = hf_value(hf, "hidden_size", "size", where), hf_value(hf, "num_attention_heads", "size", where)
    head_dim = hf_value(hf, "head_dim", "size", where, hidden // heads)
    theta, scaling = rope_from_hf(hf, where)
    kwargs = dict(vocab_size=hf_value(hf, "vocab_size", "size", where), hidden=hidden,
                  layers=hf_value(hf, "num_hidden_layers", "size", where), heads=heads,
                  kv_heads=hf_value(hf, "num_key_value_heads", "size", where, heads),
                  ffn_hidden=hf_value(hf, "intermediate_size", "size", where),
                  kv_channels=0 if head_dim * heads == hidden else head_dim, qk_norm=kind in ("qwen3", "qwen3_moe"),
                  rope_theta=theta, rope_scaling=scaling, norm_eps=hf_value(hf, "rms_norm_eps", "number", where, 1e-6),
                  tie_embeddings=hf_value(hf, "tie_word_embeddings", "bool", where, False))
    if kind in MOE_BLOCK:
        kwargs |= moe_keys(hf, kind, where)
    return kwargs


def moe_keys(hf: dict, kind: str, where: str) -> dict:
    experts = hf_value(hf, "num_experts" if kind == "qwen3_moe" and "num_experts" in hf else "num_local_experts",
                       "count", where)
    top_k = hf_value(hf, "num_experts_per_tok", "size", where)
    aux = hf_value(hf, "router_aux_loss_coef", "coeff", where, 0.0)
    out = dict(num_experts=experts, top_k=top_k, score_func="softmax",
               aux_loss_coeff=top_k * aux if hf_value(hf, "output_router_logits", "bool", where, False) else 0.0)
    if kind == "mixtral":
        return out | dict(norm_topk_prob=True)
    only = hf.get("mlp_only_layers") or []
    if not (isinstance(only, list) and all(type(i) is int for i in only)):
        raise UsageError(f"{where}: mlp_only_layers={only!r} must be a list of layer indices")
    return out | dict(norm_topk_prob=hf_value(hf, "norm_topk_prob", "bool", where, False),
                      moe_ffn_hidden=hf_value(hf, "moe_intermediate_size", "size", where),
                      decoder_sparse_step=hf_value(hf, "decoder_sparse_step", "size", where, 1),
                      mlp_only_layers=tuple(only))


def model_type_of(m) -> str:
    """Which transformers family writes ``m`` back (one error line when none can)."""
    if not m.num_experts:
        return "qwen3" if m.qk_norm else "llama"
    why = []
    if m.score_func != "softmax" or m.shared_experts or m.n_groups > 1 or m.moe_layers_start:
        why.append("softmax routing without shared experts, groups or first dense layers")
    if m.qk_norm:
        return "qwen3_moe" if not why else _no_family(m, why)
    if not m.normalize_topk or m.decoder_sparse_step != 1 or m.mlp_only_layers or m.expert_ffn_hidden != m.ffn_hidden:
        why.append("Mixtral: every layer MoE, norm_topk_prob, experts as wide as ffn_hidden (else qk_norm for Qwen3-MoE)")
    return "mixtral" if not why else _no_family(m, why)


def _no_family(m, why: list[str]) -> str:
    raise UsageError(f"export to Hugging Face: this MoE model matches no transformers family we write ({'; '.join(why)})")


def gqa_hf_config(m, architectures: dict[str, str]) -> dict:
    kind = model_type_of(m)
    out = {"architectures": [architectures[kind]], "model_type": kind, "vocab_size": m.vocab_size,
           "hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
           "num_key_value_heads": m.kv_heads, "intermediate_size": m.ffn_hidden, "head_dim": m.head_dim,
           "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu",
           "attention_bias": False, "torch_dtype": "float32", "rope_parameters": rope_to_hf(m.rope_theta, m.rope_scaling),
           "max_position_embeddings": max(2048, m.rope_scaling.get("original_max_position_embeddings", 0)
                                          * int(m.rope_scaling.get("factor", 1)))}
    if kind == "llama":
        out["mlp_bias"] = False
    if kind in MOE_BLOCK:
        out |= {"num_local_experts" if kind == "mixtral" else "num_experts": m.num_experts,
                "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coeff / m.top_k,
                "output_router_logits": m.aux_loss_coeff > 0, "router_jitter_noise": 0.0, "sliding_window": None}
    if kind == "qwen3_moe":
        out |= {"moe_intermediate_size": m.expert_ffn_hidden, "norm_topk_prob": m.normalize_topk,
                "decoder_sparse_step": m.decoder_sparse_step, "mlp_only_layers": list(m.mlp_only_layers)}
    return out


def from_gqa_names(state: dict[str, torch.Tensor], m, kind: str) -> dict[str, torch.Tensor]:
    """Released names -> ours (stacked experts, the router). Missing tensors are left for the caller to report."""
    if kind not in MOE_BLOCK:
        return state
    block, proj = MOE_BLOCK[kind]
    out = dict(state)
    for i in range(m.layers):
        if not m.is_moe_layer(i):
            continue
        theirs, ours = f"model.layers.{i}.{block}.", f"model.layers.{i}.mlp."
        stack_experts(out, theirs, m.num_experts, proj)
        for w in proj:
            if f"{theirs}experts.w_{w}" in out:
                out[f"{ours}experts.w_{w}"] = out.pop(f"{theirs}experts.w_{w}")
        if theirs + "gate.weight" in out:
            out[ours + "router.weight"] = out.pop(theirs + "gate.weight")
        out[ours + "router.expert_bias"] = torch.zeros(m.num_experts)
    return out


def to_gqa_names(state: dict[str, torch.Tensor], m, architectures: dict[str, str]) -> dict[str, torch.Tensor]:
    """Ours -> the released names (inverse of :func:`from_gqa_names`)."""
    kind = model_type_of(m)
    if kind not in MOE_BLOCK:
        return state
    block, proj = MOE_BLOCK[kind]
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.router.expert_bias"):
            if t.any():
                raise UsageError(f"export to Hugging Face: {name} is not zero ([model].bias_update_rate moved it) and "
                                 f"{architectures[kind]} has no such bias")
            continue
        unstacked = unstack_experts(name, t, block, proj)
        if unstacked is not None:
            out |= unstacked
        elif name.endswith("mlp.router.weight"):
            out[name.replace("mlp.router.weight", f"{block}.gate.weight")] = t
        else:
            out[name] = t
    return out
