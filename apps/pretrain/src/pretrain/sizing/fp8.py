"""par's FP8 (``[train].fp8 = tensorwise | rowwise | blockwise | mxfp8``) in closed form, for `pretrain plan`
and ``--simulate``'s theory: which model FLOPs run as FP8 GEMMs (at FP8's rate, twice bf16's dense peak
on H100 / H200 / B200), the transient buffers of one GEMM's quantized operands, the ZeRO-3 gather in FP8
(par_tp.fp8.param_gather) against bf16's, which group each linear's amaxes are MAX-reduced over, and the
bytes of those reductions.

FP8 GEMMs: every attention and MLP linear, the shared and the routed experts (forward, input and weight
gradient); the output layer, the router and attention's scores and values stay in high precision.
The amax reductions (model/fp8.py's scale groups, par_tp.fp8.linear's six operands) are counted for the
column-parallel (q, k, v, gate, up) and row-parallel (o, down) linears of dense GQA layers; MoE layers' and
latent attention's are not in the theory (their groups are printed: the experts', the replicated linears').
"""

from __future__ import annotations

from par_tp.fp8 import RECIPES

from ..models import family_of
from .flops import param_counts, training_flops_per_token

FP8_RATE = 2.0  # FP8 dense tensor-core FLOP/s over bf16's (H100, H200, B200)
# an FP8 parameter gather's bytes per weight: one byte, and blockwise's fp32 scale per 128x128 block
# (tensorwise's 4-byte amax per tensor left out)
FP8_GATHER_BYTES_PER_PARAM = {"tensorwise": 1.0, "blockwise": 1 + 4 / 128 ** 2}


def fp8_gemm_params_per_token(m) -> int:
    """Weights one token multiplies by in FP8 GEMMs (not the output layer's, not the router's)."""
    c = param_counts(m)
    attention = c.attention_layers - 2 * m.hidden * m.layers
    return attention + c.dense_mlp * c.dense_layers + (c.shared_experts + c.top_k * c.expert) * c.moe_layers


def fp8_compute_time(m, t) -> float:
    """A step's compute time relative to bf16's (1 with [train].fp8 off or Transformer Engine's): the
    FP8 GEMMs' share of the model FLOPs at FP8_RATE, the rest at bf16's rate."""
    if t.fp8 not in RECIPES:
        return 1.0
    share = 6.0 * fp8_gemm_params_per_token(m) / training_flops_per_token(m, t.seq_len)
    return (1 - share) + share / FP8_RATE


def amax_groups(recipe: str, layout, m=None) -> dict[str, str]:
    """Per kind of linear, the groups its scales' amaxes are MAX-reduced over (never dp); with the model
    ``m``, also its replicated linears (model/fp8.py: tokens over cp and tp) by name, and the router."""
    tp = "tp" if layout.tp > 1 else None
    cp = "cp" if layout.cp > 1 else None
    etp = "etp" if layout.expert_tp > 1 else None

    def names(*groups):
        return " + ".join(g for g in groups if g) or "none"

    replicated = _replicated(m)
    if RECIPES[recipe].block_multiple > 1:  # tiles never straddle a rank: no reduction at all
        kinds = ("column-parallel", "row-parallel", "experts (w_gate, w_up, w_down)") + replicated
        return dict.fromkeys(kinds, "none") | _high_precision(m)
    if recipe == "tensorwise":
        column = row = names(tp, cp)
        experts = names(etp)
        copies = names(tp, cp)
    else:  # rowwise: over the groups splitting each GEMM's reduction dim
        column = f"{names(tp)} (input grad), {names(cp)} (weight grad)"
        row = f"{names(tp)} (forward), {names(cp)} (weight grad)"
        experts = f"{names(etp)} (forward / input grad)"
        copies = f"{names(tp, cp)} (weight grad)"  # only the tokens: cp's chunks, tp's SP share
    return {"column-parallel": column, "row-parallel": row,
            "experts (w_gate, w_up, w_down)": experts + " per source rank's rows"} | \
        dict.fromkeys(replicated, copies) | _high_precision(m)


def _replicated(m) -> tuple[str, ...]:
    """The model's FP8 linears that are not TP layers (``nn.Linear``, the shared experts' SwiGLU): the
    attention's matrices its family splits over no tp (MLA's down-projections), the shared experts, MTP's
    eh_proj."""
    if m is None:
        return ()
    family = family_of(m)
    split = set(family.tp_split) | set(family.kv_split)
    attention = [n.removesuffix(".weight") for n, shape in family.attention_shapes(m, "").items()
                 if len(shape) == 2 and n.endswith(".weight") and n not in split and "norm" not in n]  # MLA's down-projections
    out = (f"attention {', '.join(attention)}",) if attention else ()
    if m.is_moe and m.shared_experts:
        out += ("shared experts (w_gate, w_up, w_down)",)
    if m.mtp_depth:
        out += ("MTP eh_proj",)
    return out


def _high_precision(m) -> dict[str, str]:
    return dict.fromkeys(("router",) if m is not None and m.is_moe else (), "high precision") | \
        {"output layer": "high precision"}


def _dense_linears(m, tp: int) -> list[tuple[str, int, int]]:
    """(kind, local in, local out) of one dense GQA layer's linears."""
    q, kv, f, h = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_hidden, m.hidden
    return [("column", h, q // tp), ("column", h, kv // tp), ("column", h, kv // tp), ("row", q // tp, h),
            ("column", h, f // tp), ("column", h, f // tp), ("row", f // tp, h)]


def amax_reduce_bytes(cfg, layout, layers: int, microbatches: int) -> dict[str, float]:
    """{group: bytes} of one step's amax all-reduces in ``layers`` dense GQA layers (par_groups.comm's
    convention: the reduced tensor)."""
    m, recipe = cfg.model, cfg.train.fp8
    if RECIPES[recipe].block_multiple > 1 or m.attention != "gqa" or m.is_moe:
        return {}
    forwards = 2 if m.recompute == "full" else 1
    rows = cfg.train.seq_len // layout.cp * layout.micro_batch  # the local matmul's tokens (SP gathers them)
    tp, cp = layout.tp > 1, layout.cp > 1
    out = {"tp": 0.0, "cp": 0.0}
    for kind, k, n in _dense_linears(m, layout.tp):
        if recipe == "tensorwise":  # forward (x, w), backward (dy, w^T, x^T): 4-byte amaxes
            fwd_tp, fwd_cp = (1, 1) if kind == "column" else (2, 1)
            bwd_tp, bwd_cp = (2, 2) if kind == "column" else (2, 2)
            out["tp"] += tp * 4 * (forwards * fwd_tp + bwd_tp)
            out["cp"] += cp * 4 * (forwards * fwd_cp + bwd_cp)
        elif kind == "column":  # rowwise: dy and w^T along out (tp); dy^T and x^T along the tokens (cp)
            out["tp"] += tp * 4 * (rows + k)
            out["cp"] += cp * 4 * (n + k)
        else:  # x and w along in (tp, in the forward); dy^T and x^T along the tokens (cp)
            out["tp"] += tp * 4 * forwards * (rows + n)
            out["cp"] += cp * 4 * (n + k)
    return {g: layers * microbatches * b for g, b in out.items() if b}


def fp8_gathered_params_per_rank(m, layout) -> float:
    """The FP8 linears' weights one rank holds (model/fp8_gather.py: the attention's and MLP's matrices,
    the shared experts', MTP's eh_proj; not the routed experts, norms, embedding, router or output layer)."""
    c = param_counts(m)
    layers = (c.attention - 2 * m.hidden) * m.layers + c.dense_mlp * c.dense_layers + c.shared_experts * c.moe_layers
    return layers / (layout.tp * layout.pp) + 2 * m.hidden ** 2 * m.mtp_depth / layout.tp


def fp8_figures(cfg, layout, params_per_rank: float) -> dict:
    """The plan's ``fp8`` block."""
    m, t = cfg.model, cfg.train
    fp8_token = 6.0 * fp8_gemm_params_per_token(m)
    total_token = training_flops_per_token(m, t.seq_len)
    share = fp8_token / total_token
    linears = [(k * n) for _, k, n in _dense_linears(m, layout.tp)] if m.attention == "gqa" else [m.hidden ** 2]
    if m.is_moe:
        linears.append(m.hidden * (m.moe_ffn_hidden or m.ffn_hidden) // layout.expert_tp)
    tokens = t.seq_len // layout.cp * layout.micro_batch
    widest = max(m.hidden, m.ffn_hidden // layout.tp)
    operands = max(linears) + tokens * widest  # one GEMM's weight and activation, one byte each
    scales = 4 * (tokens + max(linears) // m.hidden) if t.fp8 == "rowwise" else 4 * operands // 32 if t.fp8 == "mxfp8" \
        else 4 * operands // 128 if t.fp8 == "blockwise" else 8
    return {
        "recipe": t.fp8,
        "gemm_flops_per_step": fp8_token * t.seq_len * t.global_batch,
        "gemm_share_of_model_flops": share,
        "fp8_rate_over_bf16": FP8_RATE,
        "ideal_step_time_over_bf16": fp8_compute_time(m, t),
        "transient_operand_bytes": operands + scales,
        "fp8_param_gather": t.fp8_param_gather,
        **_gather_bytes(m, layout, t.fp8, params_per_rank),
        "amax_groups": {k: v for k, v in amax_groups(t.fp8, layout, m).items() if m.is_moe or not k.startswith("experts")},
    }


def _gather_bytes(m, layout, recipe: str, params_per_rank: float) -> dict:
    """One ZeRO-3 gather of a rank's params with the FP8 linears' weights in FP8 ([train].fp8_param_gather;
    rowwise and MXFP8 counted as one byte a weight, which they cannot gather), the rest in bf16, against all
    of it in bf16; and of those weights alone."""
    fp8 = min(fp8_gathered_params_per_rank(m, layout), params_per_rank)
    per_element = FP8_GATHER_BYTES_PER_PARAM.get(recipe, 1.0)
    return {"zero3_gather_bytes_per_rank_fp8": fp8 * per_element + 2 * (params_per_rank - fp8),
            "zero3_gather_bytes_per_rank_bf16": 2 * params_per_rank,
            "zero3_fp8_weights_gather_bytes_fp8": fp8 * per_element, "zero3_fp8_weights_gather_bytes_bf16": 2 * fp8}


def render_fp8(f: dict) -> str:
    groups = "; ".join(f"{k}: {v}" for k, v in f["amax_groups"].items())
    gather = "a ZeRO-3 gather in FP8 ([train].fp8_param_gather) moves" if f["fp8_param_gather"] else \
        "with [train].fp8_param_gather a ZeRO-3 gather would move"
    return (f"fp8 ({f['recipe']}): {f['gemm_flops_per_step']:.3e} GEMM FLOPs per step in FP8 "
            f"({f['gemm_share_of_model_flops']:.0%} of the model's) at {f['fp8_rate_over_bf16']:g}x bf16's rate: "
            f"ideal step time {f['ideal_step_time_over_bf16']:.2f}x bf16's; one GEMM's quantized operands "
            f"{f['transient_operand_bytes'] / 1e6:.1f} MB (transient; weights stay high precision); "
            f"{gather} {f['zero3_gather_bytes_per_rank_fp8'] / 1e9:.2f} GB per rank for bf16's "
            f"{f['zero3_gather_bytes_per_rank_bf16'] / 1e9:.2f} GB (the FP8 linears' weights "
            f"{f['zero3_fp8_weights_gather_bytes_fp8'] / 1e9:.2f} GB for "
            f"{f['zero3_fp8_weights_gather_bytes_bf16'] / 1e9:.2f} GB); amax reduced over: {groups}")
