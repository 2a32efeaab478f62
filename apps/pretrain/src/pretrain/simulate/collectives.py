"""The collectives one training step should issue on one rank, in closed form, by (op, group).

Bytes follow ``par_groups.comm``'s convention (all-reduce: its tensor; all-gather: the gathered
output; reduce-scatter: the unreduced input; send: the message). ``A`` is one micro-batch's
activation between layers, ``[S/cp, mb, H]`` in the compute dtype (the full sequence shard:
sequence parallelism gathers it before each TP region and reduce-scatters it after).
"""

from __future__ import annotations

from collections import defaultdict

from ..config.train_section import PAR_FP8
from ..sizing.activations import routed_sizes
from ..sizing.fp8 import amax_reduce_bytes
from ..sizing.muon_comm import muon_split_gather_bytes, muon_step_bytes
from ..sizing.params import chunks_of, rank_params
from ..sizing.replicas import declared_plan, replica_bytes, stage_moe_layers
from ..sizing.state import BUDDY_LEVELS, state_dtypes


def step_collectives(cfg, layout, stage: int, microbatches: int, routing=None, ep_rank: int = 0) -> dict[tuple[str, str], float]:
    """{(op, group): bytes} for one optimizer step of ``microbatches`` micro-batches on pipeline
    ``stage``; MoE token counts as ``routing`` (a ``par_moe.DeclaredRouting``) declares them for
    EP rank ``ep_rank``."""
    m, p = cfg.model, cfg.parallel
    pb, gb = (t.itemsize for t in state_dtypes(cfg.train))
    out: dict[tuple[str, str], float] = defaultdict(float)
    tokens = cfg.train.seq_len // layout.cp * layout.micro_batch
    act = tokens * m.hidden * pb
    layers = len(p.stage_layers(m.layers)[stage])
    dp = "dp" if layout.cp == 1 else "dp_cp"
    params = rank_params(cfg, layout, stage)

    # data parallel: gradients once per step; parameters gathered after the step (ZeRO-1/2) or per
    # micro-batch in forward and again in backward (ZeRO-3)
    if layout.dp * layout.cp > 1:
        n = params.dense
        if p.zero == "no_shard":
            out[("all_reduce", dp)] += n * gb
        else:  # buddies read the whole all-reduced gradient
            buddies = cfg.train.buddy_shards and p.zero in BUDDY_LEVELS
            out[("all_reduce" if buddies else "reduce_scatter", dp)] += n * gb
            gathers = 2 * microbatches if p.zero == "optim_grads_params" else 1
            out[("all_gather", dp)] += gathers * (n * pb - _fp8_gather_saving(cfg, layout, layers, pb))
    if params.experts and layout.edp > 1:  # routed experts: the same over expert data parallel
        n = params.experts
        if p.zero == "no_shard":
            out[("all_reduce", "edp")] += n * gb
        else:  # buddies (the next expert-dp rank's shard) read the whole all-reduced gradient
            buddies = cfg.train.buddy_shards and p.zero in BUDDY_LEVELS
            out[("all_reduce" if buddies else "reduce_scatter", "edp")] += n * gb
            out[("all_gather", "edp")] += (2 * microbatches if p.zero == "optim_grads_params" else 1) * n * pb
    if routing is not None and layout.ep > 1 and m.expert_balance != "none":  # replicate+replace: as placed at the start
        for key, n in _replicated_moe(cfg, layout, stage, routing, ep_rank).items():
            out[key] += microbatches * n
    elif routing is not None and layout.ep > 1:
        out[("all_to_all", "ep")] += microbatches * _moe_all_to_all(cfg, layout, stage, routing, ep_rank)
    for key, nbytes in muon_collectives(cfg, layout, params).items():
        out[key] += nbytes

    # tensor parallel: per layer and micro-batch, two regions (attention, MLP) forward and backward
    if layout.tp > 1:
        forwards = 2 if m.recompute == "full" else 1
        regions = 2 * layers * microbatches
        # a recomputed layer stops after its last saved tensor (torch's checkpoint early stop), so
        # the MLP's exit reduction runs once per layer fewer
        skipped = layers * microbatches if m.recompute == "full" else 0
        if layout.sequence_parallel:
            out[("all_gather", "tp")] += regions * (forwards + 1) * act
            out[("reduce_scatter", "tp")] += (regions * (forwards + 1) - skipped) * act
        else:
            out[("all_reduce", "tp")] += (regions * (forwards + 1) - skipped) * act
        chunks = chunks_of(cfg, layout, stage)
        if 0 in chunks:  # vocab-parallel embedding: partial rows all-reduced (reduce-scattered with SP,
            if layout.sequence_parallel:  # whose backward gathers)
                out[("reduce_scatter", "tp")] += microbatches * act
                out[("all_gather", "tp")] += microbatches * act
            else:
                out[("all_reduce", "tp")] += microbatches * act
        if layout.pp * layout.chunks_per_rank - 1 in chunks:  # lm_head input gathered; loss: max + 3 sums
            if layout.sequence_parallel:
                out[("all_gather", "tp")] += microbatches * act
                out[("reduce_scatter", "tp")] += microbatches * act
            out[("all_reduce", "tp")] += microbatches * tokens * 4 * 4

    if cfg.train.fp8 in PAR_FP8:  # par's FP8: the amax MAX-reductions (dense GQA layers; sizing/fp8.py)
        for group, nbytes in amax_reduce_bytes(cfg, layout, layers, microbatches).items():
            out[("all_reduce", group)] += nbytes

    # pipeline: one message per activation and per input gradient that leaves this rank
    if layout.pp > 1:
        from par_pp import build_schedule

        schedule = build_schedule(p.schedule, layout.pp, microbatches, vpp=layout.vpp)
        message = act // (layout.tp if layout.sequence_parallel else 1)
        out[("send", "pp")] += len(schedule.sends(stage)) * message
    return dict(out)


def _fp8_gather_saving(cfg, layout, layers: int, pb: int) -> float:
    """Bytes one ZeRO-3 gather of this stage saves with [train].fp8_param_gather: its FP8 linears' weights
    (this stage's share of the rank's, sizing/fp8.py) in FP8 bytes + scales instead of the param dtype."""
    if not cfg.train.fp8_param_gather:
        return 0.0
    from ..sizing.fp8 import FP8_GATHER_BYTES_PER_PARAM, fp8_gathered_params_per_rank

    weights = fp8_gathered_params_per_rank(cfg.model, layout) * layout.pp * layers / cfg.model.layers
    return weights * (pb - FP8_GATHER_BYTES_PER_PARAM[cfg.train.fp8])


def muon_collectives(cfg, layout, params) -> dict[tuple[str, str], float]:
    """{(op, group): bytes} of a Muon step's owner exchange (sizing/muon_comm.py) on a rank holding
    ``params``: the buckets holding Muon matrices taken as those matrices (a bucket also holding norms,
    biases or a small embedding moves them too; a bucket of the embedding or head alone moves nothing),
    the model-parallel gathers at the mean owned share."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    if cfg.train.optimizer_declaration.gathers != "matrix":  # an element-wise step gathers nothing
        return out
    ns, zero, dp = cfg.train.muon_ns_dtype, cfg.parallel.zero, "dp" if layout.cp == 1 else "dp_cp"
    buddy = bool(cfg.train.buddy_shards) and zero in BUDDY_LEVELS
    for n, d, group in ((params.muon_dense, layout.dp * layout.cp, dp), (params.experts, layout.edp, "edp")):
        for op, nbytes in muon_step_bytes(n, d, zero, ns, buddy).items():
            out[(op, group)] += nbytes
    if layout.tp > 1:
        out[("all_gather", "tp")] += muon_split_gather_bytes(params.muon_dense / (layout.dp * layout.cp), layout.tp)
    if layout.etp > 1 and params.experts:
        out[("all_gather", "etp")] += muon_split_gather_bytes(params.experts / layout.edp, layout.etp)
    return out


def _moe_all_to_all(cfg, layout, stage: int, routing, ep_rank: int) -> float:
    """All-to-all bytes of one micro-batch's MoE layers on this stage: each forward (twice under
    full recomputation) exchanges the counts (int64 per EP rank), dispatches the rows with their k
    slots' weights and expert ids (h + 2k wide) and combines one h-wide row per received row;
    backward sends both gradients back the other way."""
    m, pb = cfg.model, state_dtypes(cfg.train)[0].itemsize
    sizes = routed_sizes(cfg, layout, routing, ep_rank)
    sent, received = sum(sizes.send), sum(sizes.receive)
    dispatch, combine = sent * (m.hidden + 2 * m.top_k) * pb, received * m.hidden * pb
    forwards = 2 if m.recompute == "full" else 1
    backward = received * (m.hidden + 2 * m.top_k) * pb + sent * m.hidden * pb
    layers = [*cfg.parallel.stage_layers(m.layers)[stage]]
    if layout.pp * layout.chunks_per_rank - 1 in chunks_of(cfg, layout, stage):
        layers += range(m.layers, m.layers + m.mtp_depth)
    moe_layers = sum(m.is_moe_layer(i) for i in layers)
    return moe_layers * (forwards * (layout.ep * 8 + dispatch + combine) + backward)


def _replicated_moe(cfg, layout, stage: int, routing, ep_rank: int) -> dict[tuple[str, str], float]:
    """expert_balance = "replicate", one micro-batch's MoE layers on this stage, from the declared plan
    (sizing.replicas). All-to-all dispatcher: each forward all-gathers the pairs per expert (int64
    [ep, E]), sends one h-wide row per pair, fetches the replicas' weights and returns each pair's
    output row; backward: the output rows' gradients, the replicas' gradients home, the rows'
    gradients. All-gather dispatcher: the replicas' weights and gradients are its only all-to-alls."""
    m, pb = cfg.model, state_dtypes(cfg.train)[0].itemsize
    plan = declared_plan(cfg, layout, routed_sizes(cfg, layout, routing, ep_rank).pairs)
    sent = sum(plan.sent(ep_rank, d) for d in range(plan.ep)) * m.hidden * pb
    got = sum(plan.sent(s, ep_rank) for s in range(plan.ep)) * m.hidden * pb
    fetch = replica_bytes(m, layout.etp, plan.fetched(ep_rank), pb)
    back = replica_bytes(m, layout.etp, len(plan.replicas[ep_rank]), pb)
    forwards, layers = 2 if m.recompute == "full" else 1, stage_moe_layers(cfg, layout, stage)
    if m.dispatcher == "allgather":  # the tokens travel by all-gather / reduce-scatter (not modelled here)
        return {("all_to_all", "ep"): layers * (forwards * fetch + back)}
    return {("all_gather", "ep"): layers * forwards * layout.ep * m.num_experts * 8,
            ("all_to_all", "ep"): layers * (forwards * (sent + fetch + got) + sent + back + got)}


def compare(measured: list[dict], theory: dict[tuple[str, str], float]) -> list[dict]:
    """Measured rows with the theory beside them (small norm and loss reductions have none)."""
    rows = []
    for r in measured:
        want = theory.get((r["op"], r["group"]))
        rows.append(dict(r, theory_bytes=want, ratio=(r["bytes"] / want) if want else None))
    seen = {(r["op"], r["group"]) for r in measured}
    for (op, group), want in theory.items():
        if (op, group) not in seen and want:
            rows.append({"op": op, "group": group, "count": 0, "bytes": 0, "theory_bytes": want, "ratio": 0.0})
    return rows
