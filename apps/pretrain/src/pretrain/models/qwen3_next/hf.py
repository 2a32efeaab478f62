"""Hugging Face Qwen3-Next (``model_type = qwen3_next``, dense or MoE) and Qwen3.5's language models
(``qwen3_5``, ``qwen3_5_moe`` and their ``_text`` models: ``qwen3_5.py``) import; export writes
``qwen3_next`` (the same model). The released multi-token-prediction tensors (``mtp.*``) are not read.

Names are the released ones but for two things: the linear layers' ``linear_attn.conv1d.weight``
(``[C, 1, K]``, channels query | key | value) is kept as ``conv_q``, ``conv_k``, ``conv_v`` (``[C_part, K]``:
each splits over tp in one block), and every zero-centred RMSNorm (the layers' two, the final one,
the full-attention layers' ``q_norm``/``k_norm``) holds ``1 + w`` (the linear layers' gated norm is a
plain one, unchanged). Qwen3.5 holds the linear layers' projections apart (``qwen3_5.py`` regroups them).

MoE layers (as Qwen3-MoE's, ``gqa/hf.py``): ``mlp.gate.weight`` and ``mlp.experts.N.{gate,up,down}_proj.weight``
are our ``mlp.router.weight`` and stacked ``mlp.experts.w_{gate,up,down}``; the shared expert
``mlp.shared_expert.{gate,up,down}_proj.weight`` and its gate ``mlp.shared_expert_gate.weight`` are our
``mlp.shared.w_{gate,up,down}`` and ``mlp.shared.gate.weight``; experts stored fused (``experts.gate_up_proj``,
``experts.down_proj``, as transformers holds them) are read too. The shared expert's width
``shared_expert_intermediate_size`` is ``[model].shared_experts`` times the experts'.
"""

from __future__ import annotations

import re

import torch

from ...errors import UsageError
from ..gqa.hf import moe_keys
from ..hf_fields import hf_value, refuse_unless, rope_from_hf, rope_to_hf, stack_experts, unstack_experts
from .pattern import is_full_attention

ZERO_CENTRED = re.compile(r"model\.(norm|layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm))\.weight")
CONV = re.compile(r"(model\.layers\.\d+\.linear_attn\.)conv1d\.weight")
QWEN3_5 = ("qwen3_5_text", "qwen3_5_moe_text")
PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
SHARED = {f"shared_expert.{theirs}.weight": f"shared.w_{ours}" for ours, theirs in PROJ.items()} | {
    "shared_expert_gate.weight": "shared.gate.weight"}


def _moe_keys(hf: dict, where: str) -> dict:
    """The MoE keys: Qwen3-MoE's (``norm_topk_prob``: always with Qwen3.5), and the shared expert's width."""
    out = moe_keys(hf, "qwen3_moe", where)
    if hf.get("model_type") == "qwen3_5_moe_text":
        out["norm_topk_prob"] = True
    shared, width = hf_value(hf, "shared_expert_intermediate_size", "size", where), out["moe_ffn_hidden"]
    if shared % width:
        raise UsageError(f"{where}: shared_expert_intermediate_size={shared} is not supported (a multiple of "
                         f"moe_intermediate_size={width})")
    return out | {"shared_experts": shared // width}


def qwen3_next_model_config(hf: dict, where: str) -> dict:
    refuse_unless(hf, where, "Qwen3-Next", hidden_act="silu", attention_bias=False, attention_dropout=0.0)
    get = lambda key, kind="size", default=...: hf_value(hf, key, kind, where, *(() if default is ... else (default,)))  # noqa: E731
    layers, hidden, heads = get("num_hidden_layers"), get("hidden_size"), get("num_attention_heads")
    rope = dict(hf.get("rope_parameters") or {}) if isinstance(hf.get("rope_parameters"), dict) else hf.get("rope_parameters")
    if isinstance(rope, dict) and hf.get("model_type") in QWEN3_5:  # text only: M-RoPE's three position rows are equal
        rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
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
    moe = _moe_keys(hf, where) if hf_value(hf, "num_experts", "count", where, 0) else {}
    return moe | dict(vocab_size=get("vocab_size"), hidden=hidden, layers=layers, heads=heads,
                kv_heads=get("num_key_value_heads", "size", heads),
                ffn_hidden=get("intermediate_size", "size", moe.get("moe_ffn_hidden", ...)),
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
            "linear_conv_kernel_dim": m.conv_kernel, "max_position_embeddings": 4096} | _moe_hf_config(m)


def _moe_hf_config(m) -> dict:
    if not m.num_experts:
        return {}
    return {"num_experts": m.num_experts, "num_experts_per_tok": m.top_k, "norm_topk_prob": m.normalize_topk,
            "moe_intermediate_size": m.expert_ffn_hidden, "shared_expert_intermediate_size": m.shared_experts
            * m.expert_ffn_hidden, "decoder_sparse_step": m.decoder_sparse_step,
            "mlp_only_layers": sorted(set(m.mlp_only_layers) | set(range(m.moe_layers_start))),
            "router_aux_loss_coef": m.aux_loss_coeff / m.top_k, "output_router_logits": m.aux_loss_coeff > 0}


def _conv_widths(m) -> list[int]:
    return [m.linear_key_heads * m.linear_key_dim] * 2 + [m.linear_value_heads * m.linear_value_dim]


def from_qwen3_next_names(state: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Released names -> ours (module docstring). A tensor of the wrong shape is left for the caller to report."""
    state, out = {k: v for k, v in state.items() if not k.startswith("mtp.")}, {}  # released MTP: not ours
    for i in range(m.layers):
        if m.is_moe_layer(i):
            p = f"model.layers.{i}.mlp."
            stack_experts(state, p, m.num_experts, PROJ)
            if p + "experts.gate_up_proj" in state:  # stored fused, as transformers holds them: [E, 2F, H], [E, H, F]
                state[p + "experts.w_gate"], state[p + "experts.w_up"] = state.pop(p + "experts.gate_up_proj").chunk(2, 1)
            if p + "experts.down_proj" in state:
                state[p + "experts.w_down"] = state.pop(p + "experts.down_proj")
            renames = {"gate.weight": "router.weight"} | SHARED
            state |= {p + ours: state.pop(p + theirs) for theirs, ours in renames.items() if p + theirs in state}
            state[p + "router.expert_bias"] = torch.zeros(m.num_experts)
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
    out, back = {}, {ours: theirs for theirs, ours in SHARED.items()} | {"router.weight": "gate.weight"}
    for name, t in state.items():
        head, _, tail = name.partition(".mlp.")
        if tail == "router.expert_bias":
            if t.any():
                raise UsageError(f"export to Hugging Face: {name} is not zero ([model].bias_update_rate moved it) and "
                                 f"Qwen3NextForCausalLM has no such bias")
        elif tail.startswith("experts.w_"):
            out |= unstack_experts(name, t, "mlp", PROJ)
        elif tail in back:
            out[f"{head}.mlp.{back[tail]}"] = t
        elif name.endswith(".linear_attn.conv_q"):
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
