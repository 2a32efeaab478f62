"""The grouped-query-attention family's declaration (see ``models/family.py`` for what each entry means).

Per layer: ``q_proj`` (heads x head_dim), ``k_proj`` and ``v_proj`` (kv_heads x head_dim), ``o_proj``,
and with ``qk_norm`` (Qwen3) one RMSNorm over each query and key head. Tensor parallelism splits the
query heads, and the KV heads when tp divides them (else each rank holds the one KV head its query
heads use). HF names are ours, so dense models copy over unchanged (``hf.py``: the MoE names).
"""

from __future__ import annotations

from ..family import Family, need


def _kv_width(m, tp: int) -> int:
    """KV heads' width on one tp rank: split when tp divides them, else one head (replicated)."""
    return (m.kv_heads // tp if m.kv_heads % tp == 0 else 1) * m.head_dim


class GQA(Family):
    attention = "gqa"
    keys = ("kv_channels", "qk_norm")
    supports = frozenset({"dynamic_cp", "attention_dropout", "muon_qk_clip", "te_norm_fusion"})
    tp_split = ("q_proj.weight", "o_proj.weight")
    kv_split = ("k_proj.weight", "v_proj.weight")  # split over tp when it divides kv_heads
    # par_tp.TPAttention's wq/wk/wv/wo, and the core's Qwen3 norms
    renames = {f"self_attn.w{n}.weight": f"self_attn.{n}_proj.weight" for n in "qkvo"} | {
        f"self_attn.core.{n}_norm.weight": f"self_attn.{n}_norm.weight" for n in "qk"}
    hf_architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}

    def check(self, m) -> None:
        need(m.kv_channels or m.hidden % m.heads == 0,
             f"[model].heads={m.heads} does not divide hidden={m.hidden} (or set kv_channels)")
        need(m.head_dim % 2 == 0, f"head_dim=hidden/heads={m.head_dim} must be even for RoPE")

    def qk_head_dim(self, m) -> int:
        return m.head_dim

    def value_width(self, m) -> int:
        return m.head_dim

    def attention_shapes(self, m, prefix: str) -> dict[str, tuple[int, ...]]:
        d, h = m.head_dim, m.hidden
        out = {"q_proj.weight": (m.heads * d, h), "k_proj.weight": (m.kv_heads * d, h),
               "v_proj.weight": (m.kv_heads * d, h), "o_proj.weight": (h, m.heads * d)}
        if m.qk_norm:
            out |= {"q_norm.weight": (d,), "k_norm.weight": (d,)}
        return {prefix + k: v for k, v in out.items()}

    def build_attention(self, config, context, index: int):
        from par_tp import TPAttention

        from .attention import RopeThenContextAttention

        return TPAttention(config.hidden, config.heads, config.kv_heads, context.groups.tp, context.sequence_parallel,
                           core=RopeThenContextAttention(config, context, index), head_dim=config.head_dim,
                           comm_overlap=context.tp_comm_overlap)

    def saved_bytes(self, m, layout, recompute: str, pb: int) -> float:
        """The TP region's gathered input (h), q, k and v, and the core's output (q width, which the
        output projection saves as a view of it). Recomputing the core (RoPE inside), its checkpoint keeps
        q and k before RoPE; without, RoPE keeps its cos and sin (cast from the fp32 tables: none in fp32)
        per position, and the fused kernel its fp32 log-sum-exp per query head, beside the RoPE'd q and k."""
        q = m.heads * m.head_dim / layout.tp
        kv = _kv_width(m, layout.tp)
        rope = 2 * m.head_dim * pb * (pb < 4) / layout.micro_batch  # a table's row serves the micro-batch's sequences
        core = rope + 4 * m.heads / layout.tp if recompute == "none" else 0
        return (m.hidden + 2 * q + 2 * kv) * pb + core

    def ring_widths(self, m, layout) -> tuple[float, float]:
        return m.heads * m.head_dim / layout.tp, _kv_width(m, layout.tp)

    def tp_split_widths(self, m, tp: int) -> list[tuple[str, int]]:
        widths = [("[model].heads x head_dim", m.heads * m.head_dim)]
        if m.kv_heads % tp == 0:  # else each rank holds one whole KV head
            widths.append(("[model].kv_heads x head_dim", m.kv_heads * m.head_dim))
        return widths

    def junction_bytes(self, m, layout, pb: int, share: int) -> float:
        """q, k, v and o's output gradients."""
        return (m.heads * m.head_dim / layout.tp + 2 * _kv_width(m, layout.tp) + m.hidden) * pb

    def narrowing(self, m, head_width: int) -> list[str]:
        return [f"model.kv_channels={head_width}"] if m.kv_channels and m.hidden > m.heads * head_width else []

    def model_config_from_hf(self, hf: dict, where: str):
        from .hf import gqa_model_config

        return gqa_model_config(hf, where)

    def hf_config(self, m) -> dict:
        from .hf import gqa_hf_config

        return gqa_hf_config(m, self.hf_architectures)

    def from_hf_names(self, state: dict, m, hf: dict) -> tuple[object, dict]:
        from .hf import from_gqa_names

        return m, from_gqa_names(state, m, hf.get("model_type") or "llama")

    def to_hf_names(self, state: dict, m) -> dict:
        from .hf import to_gqa_names

        return to_gqa_names(state, m, self.hf_architectures)
