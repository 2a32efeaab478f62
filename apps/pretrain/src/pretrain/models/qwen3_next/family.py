"""Qwen3-Next's declaration (see ``models/family.py`` for what each entry means).

A hybrid: layer ``i`` is a full-attention layer when ``(i + 1) % full_attention_interval == 0``
(``gated_attention.py``: ``q_proj`` with an output gate, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
``k_norm``, partial RoPE), else a Gated DeltaNet layer (``gdn.py``; HF names under ``linear_attn.``).
Tensor parallelism splits both by heads (the linear layers by key heads: their value heads, conv
channels and gates go with them). Context parallelism: the full-attention layers use par-cp's
attention, the linear ones pass their recurrent state along the pieces (``par_cp.state_passing``), or
under the all-to-all kinds split their key heads over the a2a ranks (``gdn.py``).
The layers' RMSNorms are zero-centred in the released checkpoints (``x_hat * (1 + w)``); ours hold
``1 + w`` (``hf.py`` converts), so they are the common norms. MoE layers (``num_experts > 0``, Qwen3-Next
and Qwen3.5-MoE) are par-moe's softmax top-k with a sigmoid-gated shared expert (``moe.py``), split
over ep as every family's.
"""

from __future__ import annotations

from ..family import Family, need
from .pattern import is_full_attention

ATTENTION = "qwen3_next"
GDN = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv_q", "conv_k", "conv_v", "A_log", "dt_bias", "norm.weight",
       "out_proj.weight")


def layer_index(prefix: str) -> int:
    """The layer of an attention prefix ``model.layers.{i}.self_attn.``."""
    return int(prefix.split(".")[2])


class Qwen3Next(Family):
    attention = ATTENTION
    keys = ("full_attention_interval", "linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim",
            "conv_kernel", "partial_rotary_factor")
    supports = frozenset()
    dimensions = ("tp", "cp", "pp", "ep")
    tp_split = ("q_proj.weight", "o_proj.weight", "k_proj.weight", "v_proj.weight") + tuple(
        f"linear_attn.{n.split('.')[0]}" if "." not in n else n for n in GDN if n != "norm.weight")
    renames = {f"self_attn.{n}": f"linear_attn.{n}" for n in GDN}
    # Qwen3.5's read too (the language model, its linear projections regrouped: qwen3_5.py); export writes qwen3_next
    hf_architectures = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                        "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}

    def check(self, m) -> None:
        need(m.full_attention_interval >= 1, f"[model].full_attention_interval={m.full_attention_interval} must be >= 1")
        for name in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "conv_kernel"):
            need(getattr(m, name) >= 1, f"[model].{name}={getattr(m, name)} must be >= 1 with attention='{ATTENTION}'")
        need(m.linear_value_heads % m.linear_key_heads == 0,
             f"[model].linear_key_heads={m.linear_key_heads} does not divide linear_value_heads={m.linear_value_heads}")
        need(0 < m.partial_rotary_factor <= 1 and int(m.head_dim * m.partial_rotary_factor) % 2 == 0,
             f"[model].partial_rotary_factor={m.partial_rotary_factor} must be in (0, 1] and turn an even number of "
             f"head_dim={m.head_dim} channels")
        need(not m.mtp_depth, f"[model].mtp_depth={m.mtp_depth} must be 0 with attention='{ATTENTION}'")
        if m.num_experts:  # its MoE routes by a softmax over all the experts, unscaled
            for key, want in (("score_func", "softmax"), ("n_groups", 1), ("routed_scaling", 1.0)):
                need(getattr(m, key) == want, f"[model].{key}={getattr(m, key)!r} is not supported with "
                                              f"attention='{ATTENTION}' and experts (use {want!r})")
            need(m.shared_experts >= 1, f"[model].shared_experts={m.shared_experts} must be >= 1 with "
                                        f"attention='{ATTENTION}' (its MoE layers have a sigmoid-gated shared expert)")

    def check_layout(self, cfg) -> None:
        """The all-to-all kinds split the linear layers' key heads (with their value heads) over the a2a ranks."""
        p, m = cfg.parallel, cfg.model
        if p.cp > 1 and p.cp_comm_type in ("a2a", "a2a+p2p"):
            a2a, local = (p.hcp[0] if p.hcp else p.cp), m.linear_key_heads // p.tp
            need(local % a2a == 0, f"[parallel].cp_comm_type={p.cp_comm_type!r} splits the linear layers' key heads over "
                                   f"{a2a} ranks, which does not divide the {local} [model].linear_key_heads per tp rank; "
                                   f"use cp_comm_type='p2p' (the state pass) or an a2a size dividing {local}")

    def qk_head_dim(self, m) -> int:
        return m.head_dim

    def value_width(self, m) -> int:
        return m.head_dim

    def attention_shapes(self, m, prefix: str) -> dict[str, tuple[int, ...]]:
        h, d = m.hidden, m.head_dim
        if is_full_attention(m, layer_index(prefix)):
            out = {"q_proj.weight": (2 * m.heads * d, h), "k_proj.weight": (m.kv_heads * d, h),
                   "v_proj.weight": (m.kv_heads * d, h), "o_proj.weight": (h, m.heads * d),
                   "q_norm.weight": (d,), "k_norm.weight": (d,)}
            return {prefix + k: v for k, v in out.items()}
        nk, nv, dk, dv, kernel = (m.linear_key_heads, m.linear_value_heads, m.linear_key_dim, m.linear_value_dim,
                                  m.conv_kernel)
        out = {"in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, h), "in_proj_ba.weight": (2 * nv, h),
               "conv_q": (nk * dk, kernel), "conv_k": (nk * dk, kernel), "conv_v": (nv * dv, kernel),
               "A_log": (nv,), "dt_bias": (nv,), "norm.weight": (dv,), "out_proj.weight": (h, nv * dv)}
        linear = prefix[: -len("self_attn.")] + "linear_attn."
        return {linear + k: v for k, v in out.items()}

    def moe_shapes(self, m, prefix: str) -> dict[str, tuple[int, ...]]:
        return {prefix + "shared.gate.weight": (1, m.hidden)}  # the shared expert's sigmoid gate (moe.py)

    def build_moe(self, moe_config, *args, **kwargs):
        from .moe import Qwen3NextMoE

        return Qwen3NextMoE(moe_config, *args, **kwargs)

    def build_attention(self, config, context, index: int):
        if is_full_attention(config, index):
            from .gated_attention import TPGatedAttention

            return TPGatedAttention(config, context, index)
        from .gdn import TPGatedDeltaNet

        return TPGatedDeltaNet(config, context, index)

    def _fractions(self, m) -> tuple[float, float]:
        full = sum(is_full_attention(m, i) for i in range(m.layers)) / m.layers
        return full, 1 - full

    def core_flops_per_token(self, m, seq_len: int) -> float:
        """The full-attention layers' causal softmax attention; the linear layers' chunked delta rule
        (``flops.py``)."""
        from .flops import linear_core_flops

        full = sum(is_full_attention(m, i) for i in range(m.layers))
        return 3.0 * full * seq_len * m.heads * 2 * m.head_dim + (m.layers - full) * linear_core_flops(m, seq_len)

    def saved_bytes(self, m, layout, recompute: str, pb: int) -> float:
        """Per token, averaged over the layer pattern: the full layers' gathered input, q (with its gate), k,
        v and output; the linear layers' as ``memory.gdn_saved_per_token`` declares them (without
        recomputation the chunked rule's saved set, the conv's inputs, the output side; with the core
        recomputed its checkpoint's inputs and the output side)."""
        from .memory import gdn_saved_per_token

        full, linear = self._fractions(m)
        q, kv = m.heads * m.head_dim / layout.tp, m.kv_heads * m.head_dim / layout.tp
        attn = (m.hidden + 3 * q + 2 * kv) * pb
        gdn = gdn_saved_per_token(m, layout.tp, layout.cp, pb, max(layout.micro_batch, 1),
                                  "none" if recompute == "none" else "selective")
        return full * attn + linear * gdn

    def backward_bytes(self, m, layout, i: int, recomputed: bool, pb: int) -> float:
        """A linear layer's: its recomputed core's saved set and the gates' (``memory.gdn_rerun_per_token``)
        and its backward's working set (``memory.gdn_backward_work_per_token``); a full layer's core
        reruns one SDPA call."""
        from .memory import gdn_backward_work_per_token, gdn_rerun_per_token

        if is_full_attention(m, i):
            return 0.0
        tp, b = layout.tp, max(layout.micro_batch, 1)
        rerun = gdn_rerun_per_token(m, tp, layout.cp, pb, b) if recomputed else 0.0
        return rerun + gdn_backward_work_per_token(m, tp, pb)

    def ring_widths(self, m, layout) -> tuple[float, float]:
        full, _ = self._fractions(m)  # the linear layers move states, not tokens (state_bytes)
        return full * m.heads * m.head_dim / layout.tp, full * m.kv_heads * m.head_dim / layout.tp

    def junction_bytes(self, m, layout, pb: int, share: int) -> float:
        full, linear = self._fractions(m)
        q, kv = m.heads * m.head_dim / layout.tp, m.kv_heads * m.head_dim / layout.tp
        nk, nv = m.linear_key_heads / layout.tp, m.linear_value_heads / layout.tp
        proj = 2 * nk * m.linear_key_dim + 2 * nv * m.linear_value_dim + 2 * nv
        return (full * (2 * q + 2 * kv + m.hidden) + linear * (proj + m.hidden)) * pb

    def tp_split_widths(self, m, tp: int) -> list[tuple[str, int]]:
        return [("[model].heads x head_dim", m.heads * m.head_dim), ("[model].kv_heads x head_dim", m.kv_heads * m.head_dim),
                ("[model].linear_value_heads x linear_value_dim", m.linear_value_heads * m.linear_value_dim)]

    def recurrent_state(self, m, layout, micro_batch: int, pb: int = 4, cp_comm_type: str = "p2p") -> dict:
        """Per linear layer and micro-batch on one rank (fp32): the recurrent state (its value heads x
        linear_key_dim x linear_value_dim per sequence), the transition and incoming state each piece keeps
        for backward, and under context parallelism the state pass (``par_cp.state_passing``): one state
        per boundary between this rank's pieces and another rank's, forward and again backward (zigzag:
        the two ranks at the ends have one such boundary, the others two), and the conv's halo
        (``conv_kernel - 1`` tokens of its channels in the compute dtype, ``pb`` bytes). The all-to-all
        kinds split the heads over their a2a ranks first (a2a: all of cp, no state pass; a2a+p2p: the
        inner groups, the state passing over the outer ring) and send, per token, the conv's inputs with
        ``b`` and ``a`` in and the rule's output back, forward and backward. Per token: what the chunked
        rule (the scan) and the conv keep for backward (``memory.py``)."""
        from .memory import conv_channels, conv_saved_per_token, scan_saved_per_token

        a2a = {"a2a": layout.cp, "a2a+p2p": layout.hcp[0] if layout.hcp else 1}.get(cp_comm_type, 1)
        passing = layout.cp // a2a  # the ranks the state passes along
        linear = sum(not is_full_attention(m, i) for i in range(m.layers))
        heads = micro_batch * m.linear_value_heads // layout.tp // a2a
        state = heads * m.linear_key_dim * m.linear_value_dim * 4
        pieces = 2 if passing > 1 else 0  # one piece: the plain chunked rule, no transition
        boundaries = 0 if passing == 1 else 1 if passing == 2 else 2
        channels = conv_channels(m, layout.tp) // a2a
        halo = micro_batch * (m.conv_kernel - 1) * channels * pb
        r = m.linear_value_heads // m.linear_key_heads
        width = (m.linear_key_heads * (2 * m.linear_key_dim + r * m.linear_value_dim + 2 * r)
                 + m.linear_value_heads * m.linear_value_dim) // layout.tp
        return {"linear_layers": linear, "state_bytes": state,
                "saved_bytes_per_layer": pieces * (2 * state + heads * m.linear_key_dim ** 2 * 4),
                "scan_saved_bytes_per_token": scan_saved_per_token(m, layout.tp, passing),
                "conv_saved_bytes_per_token": conv_saved_per_token(m, layout.tp, pb, micro_batch),
                "cp_boundaries_per_rank": boundaries, "cp_state_bytes_per_layer": 2 * boundaries * state,
                "cp_halo_bytes_per_layer": 2 * boundaries * halo,
                "cp_a2a_bytes_per_token": 2 * (a2a - 1) / a2a * width * pb,
                "cp_bytes_per_step": 2 * boundaries * (state + halo) * linear * layout.microbatches // layout.pp}

    def narrowing(self, m, head_width: int) -> list[str]:
        """The linear layers' head widths too (the full-attention heads narrow through hidden/heads, or
        kv_channels where the released head is wider than hidden/heads)."""
        wide = [f"model.kv_channels={head_width}"] if m.kv_channels > head_width else []
        return wide + [f"model.linear_key_dim={head_width}", f"model.linear_value_dim={head_width}"]

    def layer_kind(self, m, i: int) -> int:
        return int(is_full_attention(m, i))

    def layer_period(self, m) -> int:
        return m.full_attention_interval  # its linear layers and a full-attention layer

    def model_config_from_hf(self, hf: dict, where: str):
        from .hf import qwen3_next_model_config
        from .qwen3_5 import text_config

        return qwen3_next_model_config(text_config(hf), where)

    def hf_config(self, m) -> dict:
        from .hf import qwen3_next_hf_config

        return qwen3_next_hf_config(m)

    def from_hf_names(self, state: dict, m, hf: dict) -> tuple[object, dict]:
        from .hf import QWEN3_5, from_qwen3_next_names
        from .qwen3_5 import from_qwen3_5_names, language_model, text_config

        if text_config(hf).get("model_type") in QWEN3_5:
            state = from_qwen3_5_names(language_model(state), m)
        return m, from_qwen3_next_names(state, m)

    def to_hf_names(self, state: dict, m) -> dict:
        from .hf import to_qwen3_next_names

        return to_qwen3_next_names(state, m)
