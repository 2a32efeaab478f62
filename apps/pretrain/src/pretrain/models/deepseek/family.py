"""DeepSeek-V3's declaration (see ``models/family.py`` for what each entry means).

Per layer MLA (``mla.py``): ``q_a_proj``, ``q_a_layernorm`` and ``q_b_proj`` (or one ``q_proj`` when
``q_lora_rank`` is 0), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj``.
Tensor parallelism splits the up-projections and ``o_proj`` by heads; the down-projections and the
latent norms are copies. The MTP modules (``[model].mtp_depth``) are the common ``model/mtp.py``;
this family maps them to and from the released checkpoint's ``num_nextn_predict_layers``.
"""

from __future__ import annotations

from ..family import Family, need

ATTENTION = "mla"


class DeepSeek(Family):
    attention = ATTENTION
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    supports = frozenset({"mla_up_proj"})  # [model].recompute's module: the latents' up-projections
    tp_split = ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")
    hf_architectures = {"deepseek_v3": "DeepseekV3ForCausalLM"}

    def check(self, m) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            need(getattr(m, name) >= 1, f"[model].{name}={getattr(m, name)} must be >= 1 with attention='{ATTENTION}'")
        need(m.q_lora_rank >= 0, f"[model].q_lora_rank={m.q_lora_rank} must be >= 0")
        need(m.qk_rope_head_dim % 2 == 0, f"[model].qk_rope_head_dim={m.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        need(m.kv_heads == m.heads, f"[model].kv_heads={m.kv_heads} must equal heads={m.heads} with attention='{ATTENTION}' "
                                    f"(every head has its own K and V, expanded from the latent)")
        need(not m.qk_norm and not m.kv_channels, "[model].qk_norm and kv_channels are for attention='gqa' "
                                                  "(MLA sets its widths with qk_nope/rope_head_dim, v_head_dim)")

    def qk_head_dim(self, m) -> int:
        return m.qk_nope_head_dim + m.qk_rope_head_dim

    def value_width(self, m) -> int:
        return m.v_head_dim

    def attention_shapes(self, m, prefix: str) -> dict[str, tuple[int, ...]]:
        h, n, dqk = m.hidden, m.heads, m.qk_head_dim
        out = {}
        if m.q_lora_rank:
            out |= {"q_a_proj.weight": (m.q_lora_rank, h), "q_a_layernorm.weight": (m.q_lora_rank,),
                    "q_b_proj.weight": (n * dqk, m.q_lora_rank)}
        else:
            out["q_proj.weight"] = (n * dqk, h)
        out |= {"kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
                "kv_a_layernorm.weight": (m.kv_lora_rank,),
                "kv_b_proj.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                "o_proj.weight": (h, n * m.v_head_dim)}
        return {prefix + k: v for k, v in out.items()}

    def build_attention(self, config, context, index: int):
        from ...blocks.context import context_attention
        from .mla import ContextMLACore, TPMLAttention, softmax_scale

        core = ContextMLACore(config, context_attention(context, softmax_scale(config)), context.seq_len,
                              context.recomputes("core_attn", index), context.backend)
        return TPMLAttention(config, context.groups.tp, context.sequence_parallel, core,
                             comm_overlap=context.tp_comm_overlap, recompute_up=context.recomputes("mla_up_proj", index))

    def saved_bytes(self, m, layout, recompute: str, pb: int) -> float:
        """The down-projections' input (local tokens), the gathered latents, q, k and v padded to one
        head width D, the core's output (D) and its v-wide slice, and the two latent norms in fp32
        (input upcast and normalized value)."""
        share = layout.tp if layout.sequence_parallel else 1
        n, d = m.heads / layout.tp, max(m.qk_head_dim, m.v_head_dim)
        latent = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim
        return (m.hidden / share + latent + 4 * n * d + n * m.v_head_dim) * pb + 8 * (m.q_lora_rank + m.kv_lora_rank) / share

    def ring_widths(self, m, layout) -> tuple[float, float]:
        q = m.heads / layout.tp * max(m.qk_head_dim, m.v_head_dim)  # k and v padded to one width
        return q, q

    def tp_split_widths(self, m, tp: int) -> list[tuple[str, int]]:
        return [("[model].heads x qk_head_dim", m.heads * m.qk_head_dim),
                ("[model].heads x v_head_dim", m.heads * m.v_head_dim)]

    def junction_bytes(self, m, layout, pb: int, share: int) -> float:
        """The down- and up-projections' and o's output gradients, the latent norms' fp32 products."""
        n = m.heads / layout.tp
        return (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim + n * (m.qk_head_dim + m.qk_head_dim + m.v_head_dim)
                + m.hidden) * pb + 4 * (m.q_lora_rank + m.kv_lora_rank) / share

    def narrowing(self, m, head_width: int) -> list[str]:
        small = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
        return [f"model.{key}={n}" for key, n in small.items() if getattr(m, key) > n]

    def model_config_from_hf(self, hf: dict, where: str):
        from .hf import deepseek_model_config

        return deepseek_model_config(hf, where) | {"attention": self.attention}

    def hf_config(self, m) -> dict:
        from .hf import deepseek_hf_config

        return deepseek_hf_config(m)

    def from_hf_names(self, state: dict, m, hf: dict) -> tuple[object, dict]:
        from dataclasses import replace

        from .hf import from_deepseek_names

        if m.mtp_depth and not any(k.startswith(f"model.layers.{m.layers}.") for k in state):
            m = replace(m, mtp_depth=0)  # transformers saves no MTP layers: import the main model alone
        return m, from_deepseek_names(state, m)

    def to_hf_names(self, state: dict, m) -> dict:
        from .hf import to_deepseek_names

        return to_deepseek_names(state, m)
