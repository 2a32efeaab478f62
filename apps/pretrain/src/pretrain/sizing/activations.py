"""Activation bytes one pipeline stage holds at its peak, as the trainer saves them.

Per micro-batch of a chunk (:func:`_chunk_bytes`):

* saved: with full recomputation each layer's input (the checkpoint's one saved tensor; the
  stage's sent output is freed, as Megatron's ``deallocate_output_tensor``); otherwise each
  layer's saved set (:func:`layer_per_token`) plus the received input the pipeline keeps for the
  input gradient; on the last chunk also the loss's logits (bf16, and the cross-entropy's fp32
  copy; each MTP depth its logits, fp32 copy, norms and projections);
* junctions: what a split backward (ZB-H1, ZB-V) records for its W (:func:`_junctions`);
* backward: one layer's working set beyond the saved set (under full recomputation its
  recomputed saved set, plus the MLP backward's working set);
* under ``expert_balance = "replicate"`` each MoE layer's fetched replica weights saved, and
  their gradients in its backward (:mod:`.replicas`).

:mod:`.schedule_peak` walks the stage's schedule with these, plus one activation-sized receive
buffer per neighbouring stage, and ZeRO-2/3's full gradient buffer from the first backward on.
Measured against ``plan --simulate`` (fake tensors, attention as on a GPU: one fused SDPA call).
"""

from __future__ import annotations

from ..blocks.offload_policy import modules_at as offloaded_at
from ..blocks.recompute_policy import modules_at
from ..model.expert_grads import expert_grad_scale
from ..models import family_of
from .params import by_kind, chunk_layers, chunks_of
from .replicas import declared_plan, held_replicas, replica_bytes
from .schedule_peak import ChunkBytes, StagePeak, stage_peak


def _pb(cfg) -> int:
    return 2 if cfg.train.resolved_dtype("cuda") == "bf16" else 4


def _attention(m, layout, recompute: str, pb: int) -> float:
    """Per token: the attention's saved tensors (bf16 unless said), TP-local widths, as its family
    declares them (``Family.saved_bytes``)."""
    return family_of(m).saved_bytes(m, layout, recompute, pb)


def _mlp(m, layout, i: int, pb: int, pairs: float) -> float:
    """Per token: a dense SwiGLU's gathered input (h), gate, silu(gate), up and their product
    (4 ffn/tp). An MoE layer on this rank's tokens: the router's scores, the tokens' bf16 copy and
    the combine's two outputs (3 h), per routed pair the dispatched row, the received and returned
    rows, the weighted expert output and the expert output (5 h) plus the expert activation's F/etp
    rows (``Family.expert_act_widths``: SwiGLU's 4), and the shared experts' SwiGLU (copies over tp, on local tokens). ``pairs``: routed pairs this
    rank's experts receive per local token (top_k when balanced)."""
    tp, h = layout.tp, m.hidden
    if not m.is_moe_layer(i):
        return (h + 4 * m.ffn_hidden / tp) * pb
    share = tp if layout.sequence_parallel else 1
    f = m.expert_ffn_hidden
    routed = pairs * (4 * h + family_of(m).expert_act_widths * f / layout.etp) * pb
    return (routed + 3 * h * pb + m.num_experts * (2 * pb + 4) + 4 * f * m.shared_experts * pb) / share


def layer_per_token(cfg, layout, i: int, recompute, pairs: float | None = None) -> float:
    """Bytes decoder layer ``i`` keeps for backward per token of the micro-batch: its two RMSNorms
    (fp32 input and normalized value, 8 h per token they see), attention and MLP; under full
    recomputation the layer input only. ``pairs``: see :func:`_mlp` (default: balanced routing).
    ``recompute``: a word, or a list of modules (:func:`_modules_per_token`)."""
    m, pb = cfg.model, _pb(cfg)
    share = layout.tp if layout.sequence_parallel else 1
    if not isinstance(recompute, str):
        return _modules_per_token(cfg, layout, i, modules_at(recompute, i), pairs)
    if recompute == "full":
        return m.hidden / share * pb
    pairs = m.top_k * layout.etp if pairs is None else pairs  # each etp rank: the etp group's tokens
    return 2 * 8 * m.hidden / share + _attention(m, layout, recompute, pb) + _mlp(m, layout, i, pb, pairs)


def _modules_per_token(cfg, layout, i: int, modules: frozenset, pairs: float | None) -> float:
    """:func:`layer_per_token` with ``modules`` of layer ``i`` recomputed: a recomputed module keeps its
    input (the checkpoint's one saved tensor) instead of its saved set; ``moe_act`` keeps each routed
    pair's gate, up and the product w_down reads (3 F), not the rest of the activation's; ``mla_up_proj`` reruns the MLA core too (as core_attn)."""
    m, pb = cfg.model, _pb(cfg)
    share = layout.tp if layout.sequence_parallel else 1
    if "full" in modules:
        return m.hidden / share * pb
    word = "selective" if modules & {"core_attn", "mla_up_proj"} else "none"
    pairs = m.top_k * layout.etp if pairs is None else pairs
    norms = 2 * (m.hidden / share * pb if "layernorm" in modules else 8 * m.hidden / share)
    if ("moe" if m.is_moe_layer(i) else "mlp") in modules:
        mlp = m.hidden / share * pb
    else:
        mlp = _mlp(m, layout, i, pb, pairs)
        if "moe_act" in modules and m.is_moe_layer(i):
            mlp -= pairs * (family_of(m).expert_act_widths - 3) * m.expert_ffn_hidden / layout.etp * pb / share
    return norms + _attention(m, layout, word, pb) + mlp


def _act_rerun(cfg, layout, i: int, pairs: float) -> tuple[float, float] | None:
    """Per token, where ``moe_act`` alone reruns MoE layer ``i``'s expert activation: what the rerun brings
    back (its saved set beyond the gate, up and product it keeps: ``Family.expert_act_widths`` - 3 F-wide
    rows a routed pair), and that moment's bytes beyond the layer's saved set: the rerun's set and the
    gradients of the product, gate and up (3 F), less what w_down's and the combine's backward have freed
    (the product, F, and the expert output, weighted and returned rows, 3 h); None elsewhere."""
    m = cfg.model
    modules = modules_at(m.recompute, i)
    if not m.is_moe_layer(i) or "moe_act" not in modules or modules & {"moe", "full"}:
        return None
    pb, share = _pb(cfg), layout.tp if layout.sequence_parallel else 1
    f, widths = m.expert_ffn_hidden / layout.etp, family_of(m).expert_act_widths
    return (pairs * (widths - 3) * f * pb / share, pairs * ((widths - 1) * f - 3 * m.hidden) * pb / share)


def _module_per_token(cfg, layout, i: int, module: str, pb: int) -> float:
    """Per token of the micro-batch: what ``module`` of layer ``i`` saves (0 where it is recomputed:
    its checkpoint keeps its input only, which the module before it saved)."""
    m = cfg.model
    recomputed = modules_at(m.recompute, i)
    share = layout.tp if layout.sequence_parallel else 1
    rstd = 0.0 if recomputed & {"full", "layernorm"} else 2 * 4 / share  # each norm's fp32 1/rms per token
    if module == "layer":  # its saved set as the recompute policy leaves it
        return layer_per_token(cfg, layout, i, m.recompute) + rstd
    if "full" in recomputed or module in recomputed or (module == "mlp" and "moe" in recomputed and m.is_moe_layer(i)):
        return 0.0
    if module == "layernorm":
        return 2 * 8 * m.hidden / share + rstd
    if module == "attn":
        return family_of(m).saved_bytes(m, layout, "selective" if "core_attn" in recomputed else "none", pb)
    if (module == "moe") != m.is_moe_layer(i):
        return 0.0  # mlp names the dense layers, moe the MoE ones
    return _mlp(m, layout, i, pb, m.top_k * layout.etp)


def offloaded_per_layer(cfg, layout, i: int, position: int | None) -> float:
    """Bytes per token decoder layer ``i`` (the ``position``-th of its chunk; None: MTP) moves out."""
    m = cfg.model
    if not m.offload:
        return 0.0
    modules = offloaded_at(m.offload, i, position)
    if "layer" in modules:
        modules = {"layer"}
    return sum(_module_per_token(cfg, layout, i, module, _pb(cfg)) for module in modules)


def _ring_backward_work(m, layout, pb: int) -> float:
    """Per local token: a context-parallel attention's backward working set (par-cp's ring): fp32
    dq and two steps' dk, dv, the fp32 dK|dV stack it sends home; in bf16 K|V and its spare, the
    casts of the gradients out and the blocks' temporaries (5.5 q-widths: fitted to ``plan --simulate``);
    past two ranks the ring holds four more fp32 and three more bf16 K|V widths (fitted at cp 4 and 8: MLA's
    K|V is as wide as its queries)."""
    if layout.cp == 1:
        return 0.0  # one fused SDPA call, as on a GPU
    q, kv = family_of(m).ring_widths(m, layout)
    longer = (4 * 4 + 3 * pb) * kv if layout.cp > 2 else 0.0
    return 4 * (q + 6 * kv) + pb * (4 * kv + 2 * (q + 2 * kv) + 5.5 * q) + longer


def _core_backward_work(m, layout, pb: int) -> float:
    """Per local token at cp 1: the fused attention kernel's backward (one SDPA / flash call): the
    output's gradient, dq, dk and dv at the widths it attends with, beside them the output projection's
    input gradient where the value heads are narrower than those (MLA pads v to the q/k width), and the
    residual's gradient (h)."""
    q, kv = family_of(m).ring_widths(m, layout)
    value = m.heads / layout.tp * family_of(m).value_width(m)
    share = layout.tp if layout.sequence_parallel else 1
    return (2 * q + 2 * kv + (value if value < q else 0.0) + m.hidden / share) * pb


def _moe_backward_work(m, layout, tokens: float, pairs: float, pb: int) -> float:
    """An MoE layer's backward working set beyond its saved set (:func:`_mlp`), the larger of two
    moments: the combine's backward (3 h of gradients per routed pair, once the weighted copy and
    the returned rows, 2 h, are freed) and the experts' first grouped GEMM's (w_down's) gradients
    in the compute dtype, the weight's for this rank's experts ([E/ep, h, F/etp] before it is added
    into the gradient buffer; twice where the expert gradients are scaled: the hook's scaled copy
    beside it, :mod:`pretrain.model.expert_grads`) and the rows' (F/etp per pair),
    once those two and the experts' output (3 h per pair) are freed."""
    share = layout.tp if layout.sequence_parallel else 1
    rows, h, f = pairs * tokens / share, m.hidden, m.expert_ffn_hidden / layout.etp
    copies = 1 if expert_grad_scale(layout) == 1.0 else 2
    return max(rows * h, copies * m.num_experts / layout.ep * h * f + rows * (f - 3 * h), 0.0) * pb


def _backward_work(cfg, layout, i: int, tokens: float, pairs: float, rerun: float = 0.0) -> float:
    """The largest of a layer's backward working sets: its MLP's (dense: w_down's, the output gradient
    gathered (h), one intermediate's gradient (ffn/tp) and one projection's weight gradient in the
    compute dtype, before it is added into the fp32 gradient buffer; or the product's, once w_down freed
    it: its gradient and those of silu(gate) and up (3 ffn/tp beside gate, up and silu(gate)); MoE:
    :func:`_moe_backward_work`), the MLP's norm's (:func:`_norm_backward_work`) and the
    attention's (its fused kernel's, or under context parallelism the ring's, and ``rerun`` per token: what its
    family declares beyond what the caller counted, :func:`_attention_backward`), which runs once the MLP's
    saved set is freed."""
    m, pb = cfg.model, _pb(cfg)
    core = _ring_backward_work(m, layout, pb) if layout.cp > 1 else _core_backward_work(m, layout, pb)
    attention = (core + rerun - _mlp(m, layout, i, pb, pairs)) * tokens
    norm = (_norm_backward_work(m, layout, pb) - _mlp(m, layout, i, pb, pairs)) * tokens
    if m.is_moe_layer(i):
        return max(attention, norm, _moe_backward_work(m, layout, tokens, pairs, pb))
    ffn = m.ffn_hidden / layout.tp
    down = (m.hidden + ffn) * pb * tokens + m.hidden * ffn * pb
    product = (m.hidden + 2 * ffn) * pb * tokens  # the product's three gradients, the product freed
    return max(down, product, norm, attention)


def _norm_backward_work(m, layout, pb: int) -> float:
    """Per token: the MLP's RMSNorm's backward once the MLP's saved set is freed: torch's RMSNorm
    backward's five fp32 temporaries (h each, the tokens it sees) and its gradient cast to the compute
    dtype, beside the residual's gradient, less its fp32 normalized value, freed by then (net: four fp32
    and two compute-dtype values of h)."""
    share = layout.tp if layout.sequence_parallel else 1
    return (5 * 4 - 4 + 2 * pb) * m.hidden / share


def _loss_saved(cfg, layout, tokens: float) -> float:
    """What the last chunk's loss keeps for backward: the cross-entropy's fp32 copy of the logits
    (the bf16 logits are freed once copied: :func:`_chunk_bytes` counts them as the forward's
    transient); per MTP depth its logits, the fp32 copy its loss takes and its own buffer, plus the
    final and MTP norms in fp32, their bf16 outputs, the concatenated MTP input and its projection."""
    m, pb = cfg.model, _pb(cfg)
    vocab = m.padded_vocab(layout.tp) / layout.tp
    h = m.hidden / (layout.tp if layout.sequence_parallel else 1)  # the norms see this rank's tokens
    main = vocab * 4 + h * (8 + pb)
    mtp = m.mtp_depth * (vocab * (pb + 8) + h * (3 * 8 + 5 * pb))
    return (main + mtp) * tokens


def routed_pairs(cfg, layout, routing, ep_rank: int) -> float | None:
    """Pairs per local token that EP rank ``ep_rank``'s experts receive under a declared routing."""
    if routing is None or not cfg.model.is_moe:
        return None
    share = layout.tp if layout.sequence_parallel else 1
    pairs = sum(routed_sizes(cfg, layout, routing, ep_rank).local)
    if cfg.model.expert_balance != "none" and layout.ep > 1:  # what the rank computes once balanced
        pairs = declared_plan(cfg, layout, routed_sizes(cfg, layout, routing, ep_rank).pairs).load_after[ep_rank]
    return pairs / (cfg.train.seq_len // layout.cp * layout.micro_batch // share)


def _junctions(m, layout, i: int, pb: int, pairs: float) -> float:
    """Per token: the gradients a split backward records for its W at layer ``i``'s weight
    junctions: the two norms' ``x * weight`` (fp32, this rank's tokens) and each projection's
    output gradient (the attention's as its family declares; SwiGLU: gate, up, down; MoE: the
    router and per routed pair the experts' gate, up and down)."""
    tp, h = layout.tp, m.hidden
    share = tp if layout.sequence_parallel else 1
    norms = 2 * 4 * h / share
    attention = family_of(m).junction_bytes(m, layout, pb, share)
    if not m.is_moe_layer(i):
        return norms + attention + (2 * m.ffn_hidden / tp + h) * pb
    f = m.expert_ffn_hidden
    routed = pairs * (2 * f / layout.etp + h) * pb
    return norms + attention + (routed + m.num_experts * 4 + (2 * f * m.shared_experts + h) * pb) / share


def _chunk_bytes(cfg, layout, chunk: int, layers, tokens: float, pairs: float | None, replicas: int = 0) -> ChunkBytes:
    """What one micro-batch of ``chunk`` (holding ``layers``) keeps, in bytes; ``replicas``: replica
    weight sets each MoE layer fetches (expert_balance = "replicate")."""
    m, pb = cfg.model, _pb(cfg)
    share = layout.tp if layout.sequence_parallel else 1
    message = m.hidden / share * pb * tokens
    last = chunk == layout.pp * layout.chunks_per_rank - 1
    if not isinstance(m.recompute, str) or m.offload:  # per layer: a module policy, or offloaded modules
        return _policy_chunk_bytes(cfg, layout, chunk, layers, tokens, pairs, replicas)
    layers = list(layers) + (list(range(m.layers, m.layers + m.mtp_depth)) if last else [])  # MTP: last stage
    kinds = by_kind(m, layers)
    moe_pairs = m.top_k * layout.etp if pairs is None else pairs  # each etp rank: the etp group's tokens
    saved = sum(n * layer_per_token(cfg, layout, i, m.recompute, pairs) for i, n in kinds) * tokens
    junctions = sum(n * _junctions(m, layout, i, pb, moe_pairs) for i, n in kinds) * tokens
    if m.recompute != "full" and chunk > 0:  # the received input, kept for the input gradient
        saved += message
    recomputed = "selective" if m.recompute == "full" else None
    # what each layer's attention holds in its backward beyond the selective set (or none's)
    extra = _attention_backward(cfg, layout, layers, lambda i: layer_per_token(cfg, layout, i, m.recompute, pairs),
                                lambda i: m.recompute != "none", lambda i: 0.0)
    # expert_balance = "replicate": each MoE layer keeps its fetched replica weights for backward
    # (refetched when recomputed), whose backward adds their gradients (sizing.replicas)
    replica = replica_bytes(m, layout.etp, replicas, pb)
    if not recomputed:
        saved += sum(n * replica for i, n in kinds if m.is_moe_layer(i))

    def backward(i: int, rerun: float = 0.0) -> float:  # layer i's backward: its recomputed saved set and working set
        again = layer_per_token(cfg, layout, i, recomputed, pairs) * tokens if recomputed else 0.0
        replicas = (2 if recomputed else 1) * replica if m.is_moe_layer(i) else 0.0
        return again + _backward_work(cfg, layout, i, tokens, moe_pairs, rerun) + replicas

    work = max([backward(i) for i, _ in kinds] + [backward(i, r) for i, r in extra.items()], default=0.0)
    forward = 0.0
    if last:  # the loss's logits are saved with the chunk; the head's output gradient is a junction
        vocab, loss = m.padded_vocab(layout.tp) / layout.tp, _loss_saved(cfg, layout, tokens)
        saved += loss
        forward = vocab * pb * tokens  # the bf16 logits, alive until the loss has its fp32 copy
        junctions += (vocab * pb + 4 * m.hidden / share) * tokens
        if m.mtp_depth:  # MTP's layers run backward first, while the main loss's fp32 buffer and the
            # head's gradient from MTP's use (waiting for the main use's) are alive
            work = max(work, backward(m.layers) + vocab * (4 * tokens + m.hidden * pb))
        work = max(work - loss, 0.0)  # the loss's backward frees its logits before the layers' run
    return ChunkBytes(saved, junctions, work, forward)


def _policy_chunk_bytes(cfg, layout, chunk: int, layers, tokens: float, pairs: float | None, replicas: int) -> ChunkBytes:
    """:func:`_chunk_bytes` under a per-layer policy: each layer's saved set as its recomputed modules
    leave it, less what ``[model].offload`` moves out (sizing.offload); a layer's backward also holds
    what its recomputation brings back (its whole saved set at most) and its offloaded tensors."""
    m, pb = cfg.model, _pb(cfg)
    share = layout.tp if layout.sequence_parallel else 1
    last = chunk == layout.pp * layout.chunks_per_rank - 1
    ids = list(layers) + (list(range(m.layers, m.layers + m.mtp_depth)) if last else [])
    moe_pairs = m.top_k * layout.etp if pairs is None else pairs
    kept = {i: layer_per_token(cfg, layout, i, m.recompute, pairs) * tokens for i in ids}
    out = {i: offloaded_per_layer(cfg, layout, i, position if position < len(layers) else None) * tokens
           for position, i in enumerate(ids)}
    saved = sum(kept[i] - out[i] for i in ids)
    junctions = sum(_junctions(m, layout, i, pb, moe_pairs) for i in ids) * tokens
    if chunk > 0 and not all("full" in modules_at(m.recompute, i) for i in layers):
        saved += m.hidden / share * pb * tokens  # the received input, kept for the input gradient
    replica = replica_bytes(m, layout.etp, replicas, pb)
    saved += sum(replica for i in ids if m.is_moe_layer(i))

    family = family_of(m)
    core = {i: bool(modules_at(m.recompute, i) & {"core_attn", "mla_up_proj", "full"}) for i in ids}
    averaged = family.saved_bytes(m, layout, "none", pb) - family.saved_bytes(m, layout, "selective", pb)
    # the later layers' freed sets are subtracted from the whole backward below (``freed``), not here
    extra = _attention_backward(cfg, layout, ids, lambda i: 0.0, core.get,
                                lambda i: averaged if core[i] else 0.0)  # the rerun below counts the averaged set
    # the offloaded layer before each (forward order): its last region comes back as this layer's first
    # one's backward starts (model/offload.py's prefetch, which that backward overlaps)
    prefetched, before = {}, 0.0
    for i in ids:
        prefetched[i], before = before, out[i] or before
    # a layer's backward runs once the layers after it (MTP's included) have freed their saved sets
    freed = {i: sum(kept[j] - out[j] for j in ids[n + 1:]) for n, i in enumerate(ids)}

    def backward(i: int) -> float:
        again = layer_per_token(cfg, layout, i, "none", pairs) * tokens - kept[i]  # what the rerun brings back
        work = _backward_work(cfg, layout, i, tokens, moe_pairs, extra.get(i, 0.0))
        act = _act_rerun(cfg, layout, i, moe_pairs)
        if act is not None:  # moe_act's rerun comes after w_down's backward: one moment or the other
            brought, moment = act
            again, work = again - brought * tokens, max(work, moment * tokens)
        return again + out[i] + (prefetched[i] if out[i] else 0.0) + work - freed[i]

    work, forward = max((backward(i) for i in ids), default=0.0), 0.0
    if last:
        vocab, loss = m.padded_vocab(layout.tp) / layout.tp, _loss_saved(cfg, layout, tokens)
        saved += loss
        forward = vocab * pb * tokens
        junctions += (vocab * pb + 4 * m.hidden / share) * tokens
        if m.mtp_depth:  # MTP's layers run backward first, beside the main loss's buffers (as _chunk_bytes)
            work = max(work, backward(m.layers) + vocab * (4 * tokens + m.hidden * pb))
        work = max(work - loss, 0.0)
    return ChunkBytes(saved, junctions, work, forward)


def _attention_backward(cfg, layout, ids, kept, recomputed, counted) -> dict[int, float]:
    """Per token, for the layers of ``ids`` (a chunk's, in order) whose family declares any: what the
    attention holds in its backward (``Family.backward_bytes``) beyond what the caller counts for it
    (``counted(i)``), less what the chunk's later layers, whose backward ran first, have freed by then
    (``kept(j)`` per token each)."""
    m, pb = cfg.model, _pb(cfg)
    family = family_of(m)
    declared = {i: family.backward_bytes(m, layout, i, recomputed(i), pb) for i in ids}
    if not any(declared.values()):
        return {}
    out, freed = {}, 0.0
    for i in reversed(ids):
        if declared[i]:
            out[i] = max(declared[i] - counted(i) - freed, 0.0)
        freed += kept(i)
    return out


def stage_peak_of(cfg, layout, stage: int, routing=None, ep_rank: int = 0) -> StagePeak:
    """The activation peak of pipeline ``stage`` (before / after the gradients exist); MoE token
    counts as ``routing`` (a ``par_moe.DeclaredRouting``, default balanced) declares them for EP
    rank ``ep_rank``."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    tokens = t.seq_len / layout.cp * layout.micro_batch
    share = layout.tp if layout.sequence_parallel else 1
    pairs = routed_pairs(cfg, layout, routing, ep_rank)
    ranges = chunk_layers(p, m.layers)
    declared = None if routing is None or not m.is_moe else routed_sizes(cfg, layout, routing, ep_rank).pairs
    replicas = held_replicas(cfg, layout, declared, ep_rank) if m.is_moe else 0
    chunks = {c: _chunk_bytes(cfg, layout, c, ranges[c], tokens, pairs, replicas) for c in chunks_of(cfg, layout, stage)}
    neighbours = (stage > 0) + (stage < layout.pp - 1) if layout.pp > 1 else 0
    receive = neighbours * m.hidden / share * _pb(cfg) * tokens  # one receive buffer per neighbour
    return stage_peak(p.schedule, layout.pp, layout.vpp, layout.microbatches, stage, chunks, receive)


def planned_activations(cfg, layout, stage: int, routing=None, ep_rank: int = 0, grad_buffer: float = 0.0) -> float:
    """Bytes at the stage's peak (:func:`stage_peak_of`) with ``grad_buffer`` bytes of full gradients
    alive from its first backward (ZeRO-2/3 accumulating: :func:`pretrain.sizing.state.grad_buffer`)."""
    return stage_peak_of(cfg, layout, stage, routing, ep_rank).with_grads(grad_buffer)


def routed_sizes(cfg, layout, routing, ep_rank: int):
    """The token counts a ``par_moe.DeclaredRouting`` gives one MoE layer of EP rank ``ep_rank``
    for one micro-batch: its local tokens (S/cp/tp under SP), each etp group's together."""
    m = cfg.model
    share = layout.tp if layout.sequence_parallel else 1
    tokens = cfg.train.seq_len // layout.cp * layout.micro_batch // share
    return routing.sizes(tokens * layout.etp, m.top_k, m.num_experts, layout.ep, ep_rank)
