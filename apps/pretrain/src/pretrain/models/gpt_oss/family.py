"""gpt-oss's declaration (see ``models/family.py`` for what each entry means).

Grouped-query attention (so GQA's sizing and narrowing) with biases on ``q_proj``, ``k_proj``,
``v_proj`` and ``o_proj``, one learned ``sinks`` logit per head, YaRN RoPE, and a 128-token sliding
window on every even layer (``attention.py``). Every layer is MoE: a router with a bias, experts with
biases and a clamped SwiGLU (``moe.py``). Tensor parallelism splits the heads with their biases and
sinks, and needs to divide the KV heads. HF: ``hf.py``.
"""

from __future__ import annotations

from ..family import need
from ..gqa.family import GQA

ATTENTION = "gpt_oss"


class GptOss(GQA):
    attention = ATTENTION
    keys = ("kv_channels",)
    supports = frozenset()
    tp_split = ("q_proj.weight", "q_proj.bias", "o_proj.weight", "self_attn.sinks")
    kv_split = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
    renames = {}
    hf_architectures = {"gpt_oss": "GptOssForCausalLM"}
    # the clamped SwiGLU keeps gate and up (their clamps' inputs), the clamped gate, its sigmoid, the gated
    # value, up + 1 and the product w_down reads (moe.py)
    expert_act_widths = 7

    def check(self, m) -> None:
        super().check(m)
        need(m.num_experts >= 1 and m.moe_layers_start == 0 and m.decoder_sparse_step == 1 and not m.mlp_only_layers,
             f"[model].attention='{ATTENTION}' has experts in every layer: set num_experts >= 1, moe_layers_start = 0, "
             f"decoder_sparse_step = 1 and no mlp_only_layers")
        need(m.score_func == "softmax" and m.normalize_topk and not m.shared_experts and m.n_groups == 1,
             f"[model].attention='{ATTENTION}' routes by a softmax over each token's top_k (score_func = 'softmax', "
             f"norm_topk_prob = true, no shared_experts, n_groups = 1)")
        for key, off in (("qk_norm", False), ("mtp_depth", 0), ("expert_balance", "none"), ("backend", "torch")):
            need(getattr(m, key) == off, f"[model].{key}={getattr(m, key)!r} is not supported with "
                                         f"attention='{ATTENTION}' (use {off!r})")

    def check_layout(self, cfg) -> None:
        m, p, where = cfg.model, cfg.parallel, f"with [model].attention='{ATTENTION}'"
        need(m.kv_heads % p.tp == 0, f"[parallel].tp={p.tp} must divide [model].kv_heads={m.kv_heads} {where} "
                                     f"(its KV heads and their biases are split, not replicated)")
        need(p.expert_tp == 1, f"[parallel].etp={p.expert_tp} is not supported {where} (the experts' down bias is "
                               f"not split): set parallel.etp=1")
        need(p.cp_comm_type in ("p2p", "a2a", "allgather"),
             f"[parallel].cp_comm_type={p.cp_comm_type!r} is not supported {where}: use p2p, a2a or allgather")
        need(not cfg.data.document_mask, f"[data].document_mask=true is not supported {where} (its attention does "
                                         f"not mask packed documents)")

    def attention_shapes(self, m, prefix: str) -> dict[str, tuple[int, ...]]:
        d, h, n, kv = m.head_dim, m.hidden, m.heads, m.kv_heads
        out = {"q_proj.weight": (n * d, h), "q_proj.bias": (n * d,), "k_proj.weight": (kv * d, h), "k_proj.bias": (kv * d,),
               "v_proj.weight": (kv * d, h), "v_proj.bias": (kv * d,), "o_proj.weight": (h, n * d), "o_proj.bias": (h,),
               "sinks": (n,)}
        return {prefix + k: v for k, v in out.items()}

    def moe_shapes(self, m, prefix: str) -> dict[str, tuple[int, ...]]:
        e, f, h = m.num_experts, m.expert_ffn_hidden, m.hidden
        return {prefix + "router.bias": (e,), prefix + "experts.b_gate": (e, f), prefix + "experts.b_up": (e, f),
                prefix + "experts.b_down": (e, h)}

    def build_attention(self, config, context, index: int):
        from .attention import GptOssAttention

        tp = context.groups.size("tp")
        if config.kv_heads % tp:
            raise ValueError(f"attention='{ATTENTION}' needs tp={tp} to divide kv_heads={config.kv_heads}")
        return GptOssAttention(config, context, index)

    def build_moe(self, moe_config, *args, **kwargs):
        from .moe import GptOssMoE

        return GptOssMoE(moe_config, *args, **kwargs)

    def model_config_from_hf(self, hf: dict, where: str) -> dict:
        from .hf import gpt_oss_model_config

        return gpt_oss_model_config(hf, where)

    def hf_config(self, m) -> dict:
        from .hf import gpt_oss_hf_config

        return gpt_oss_hf_config(m)

    def from_hf_names(self, state: dict, m, hf: dict) -> tuple[object, dict]:
        from .hf import from_gpt_oss_names

        return m, from_gpt_oss_names(state, m)

    def to_hf_names(self, state: dict, m) -> dict:
        from .hf import to_gpt_oss_names

        return to_gpt_oss_names(state, m)
