"""The shape of every tensor of the full (unsharded) model, by its Hugging Face name.

One place for shapes: decoder layers (GQA or MLA attention, dense or MoE MLP), the embedding and
head, and the multi-token-prediction modules. Initialisation (``initial_state.py``), checkpoints,
HF import/export and the sizing (``pretrain.sizing.params``) all read them from here.
:func:`hf_name` maps a chunk's state-dict name to the full model's.
"""

from __future__ import annotations


def layer_shapes(config, i: int) -> dict[str, tuple[int, ...]]:
    """Shapes of decoder layer ``i``'s tensors (HF names under ``model.layers.{i}.``)."""
    d, h, p = config.head_dim, config.hidden, f"model.layers.{i}."
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    if config.attention == "mla":
        shapes |= mla_shapes(config, p + "self_attn.")
    else:
        shapes |= {p + "self_attn.q_proj.weight": (config.heads * d, h), p + "self_attn.k_proj.weight": (config.kv_heads * d, h),
                   p + "self_attn.v_proj.weight": (config.kv_heads * d, h), p + "self_attn.o_proj.weight": (h, config.heads * d)}
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    if config.is_moe_layer(i):
        e, f = config.num_experts, config.moe_ffn_hidden or config.ffn_hidden
        shapes |= {p + "mlp.router.weight": (e, h), p + "mlp.router.expert_bias": (e,),
                   p + "mlp.experts.w_gate": (e, f, h), p + "mlp.experts.w_up": (e, f, h),
                   p + "mlp.experts.w_down": (e, h, f)}
        if config.shared_experts:
            fs = config.shared_experts * f
            shapes |= {p + "mlp.shared.w_gate": (fs, h), p + "mlp.shared.w_up": (fs, h), p + "mlp.shared.w_down": (h, fs)}
    else:
        f = config.ffn_hidden
        shapes |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    return shapes


def full_shapes(config) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of the full state dict (HF names), without building the model."""
    h = config.hidden
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,), "lm_head.weight": (config.vocab_size, h)}
    for i in range(config.layers):
        shapes |= layer_shapes(config, i)
    return shapes | mtp_shapes(config)


def mla_shapes(config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Full shapes of one layer's MLA tensors (HF names under ``prefix``, e.g. ``model.layers.0.self_attn.``)."""
    h, n, dqk = config.hidden, config.heads, config.qk_head_dim
    out = {}
    if config.q_lora_rank:
        out |= {"q_a_proj.weight": (config.q_lora_rank, h), "q_a_layernorm.weight": (config.q_lora_rank,),
                "q_b_proj.weight": (n * dqk, config.q_lora_rank)}
    else:
        out["q_proj.weight"] = (n * dqk, h)
    out |= {"kv_a_proj_with_mqa.weight": (config.kv_lora_rank + config.qk_rope_head_dim, h),
            "kv_a_layernorm.weight": (config.kv_lora_rank,),
            "kv_b_proj.weight": (n * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank),
            "o_proj.weight": (h, n * config.v_head_dim)}
    return {prefix + k: v for k, v in out.items()}


def mtp_layer_ids(config) -> range:
    return range(config.layers, config.layers + config.mtp_depth)


def mtp_shapes(config) -> dict[str, tuple[int, ...]]:
    h, out = config.hidden, {}
    for j in mtp_layer_ids(config):
        p = f"model.layers.{j}."
        out |= {p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                p + "shared_head.norm.weight": (h,)} | layer_shapes(config, j)
    return out


# chunk state-dict names that differ from the full model's (Hugging Face) names, below "layers.<i>."
HF_RENAMES = {f"self_attn.w{n}.weight": f"self_attn.{n}_proj.weight" for n in "qkvo"} | {
    f"mlp.{n}.weight": f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")} | {
    f"self_attn.core.{n}_norm.weight": f"self_attn.{n}_norm.weight" for n in "qk"}


def hf_name(name: str, tied: bool = False) -> str:
    """The full model's (Hugging Face) name of a chunk's state-dict entry (MTP layer j is ``model.layers.j``).
    ``tied``: the head's weight is the input embedding (one tensor, saved once, under that name)."""
    if name == "shared_embedding.weight" or (tied and name == "lm_head.weight"):  # copies of chunk 0's embedding
        return "model.embed_tokens.weight"
    if name.startswith(("layers.", "mtp.")):
        _, i, rest = name.split(".", 2)
        return f"model.layers.{i}." + HF_RENAMES.get(rest, rest)
    return name if name == "lm_head.weight" else "model." + name
