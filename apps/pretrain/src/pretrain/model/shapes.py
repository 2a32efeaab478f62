"""The shape of every tensor of the full (unsharded) model, by its Hugging Face name.

One place for shapes: decoder layers (the attention family's tensors, ``pretrain.models``; dense or MoE MLP), the embedding and
head, and the multi-token-prediction modules. Initialisation (``initial_state.py``), checkpoints,
HF import/export and the sizing (``pretrain.sizing.params``) all read them from here.
:func:`hf_name` maps a chunk's state-dict name to the full model's.
"""

from __future__ import annotations

from ..models import FAMILIES, family_of


def layer_shapes(config, i: int) -> dict[str, tuple[int, ...]]:
    """Shapes of decoder layer ``i``'s tensors (HF names under ``model.layers.{i}.``)."""
    h, p = config.hidden, f"model.layers.{i}."
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes |= family_of(config).attention_shapes(config, p + "self_attn.")
    if config.is_moe_layer(i):
        e, f = config.num_experts, config.moe_ffn_hidden or config.ffn_hidden
        shapes |= {p + "mlp.router.weight": (e, h), p + "mlp.router.expert_bias": (e,),
                   p + "mlp.experts.w_gate": (e, f, h), p + "mlp.experts.w_up": (e, f, h),
                   p + "mlp.experts.w_down": (e, h, f)} | family_of(config).moe_shapes(config, p + "mlp.")
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


def mtp_layer_ids(config) -> range:
    return range(config.layers, config.layers + config.mtp_depth)


def mtp_shapes(config) -> dict[str, tuple[int, ...]]:
    h, out = config.hidden, {}
    for j in mtp_layer_ids(config):
        p = f"model.layers.{j}."
        out |= {p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                p + "shared_head.norm.weight": (h,)} | layer_shapes(config, j)
    return out


# chunk state-dict names that differ from the full model's (Hugging Face) names, below "layers.<i>.":
# the dense MLP's, and each family's attention's (``Family.renames``)
HF_RENAMES = {f"mlp.{n}.weight": f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")} | {
    ours: theirs for family in FAMILIES for ours, theirs in family.renames.items()}


def hf_name(name: str, tied: bool = False) -> str:
    """The full model's (Hugging Face) name of a chunk's state-dict entry (MTP layer j is ``model.layers.j``).
    ``tied``: the head's weight is the input embedding (one tensor, saved once, under that name)."""
    if name == "shared_embedding.weight" or (tied and name == "lm_head.weight"):  # copies of chunk 0's embedding
        return "model.embed_tokens.weight"
    if name.startswith(("layers.", "mtp.")):
        _, i, rest = name.split(".", 2)
        return f"model.layers.{i}." + HF_RENAMES.get(rest, rest)
    return name if name == "lm_head.weight" else "model." + name
