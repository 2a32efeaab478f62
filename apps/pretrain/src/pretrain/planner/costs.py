"""`pretrain plan CONFIG --world N`: what a config's layout costs per rank, before launching anything.

Memory is :mod:`pretrain.sizing`'s, the figures `plan --simulate` measures the trainer against:
model state in par-zero's convention (bf16 params, grads in ``[train].grad_reduce_dtype``, fp32
main weights and Adam moments) for every ZeRO strategy, plus the activations of the heaviest
pipeline stage, within the GPU memory less the headroom. The decision tree is the explainer's:
DDP if it fits, then ZeRO-1, then ZeRO-2 / ZeRO-3, then HSDP when a ZeRO-3 dp group crosses nodes.
"""

from __future__ import annotations

from ..errors import UsageError
from ..models import family_of
from ..config.train_section import PAR_FP8
from ..sizing.fp8_gather_rows import fp8_gather_misfit
from ..sizing.flops import mtp_params, param_counts, training_flops_per_step, training_flops_per_token
from ..sizing.memory import HEADROOM, budget_bytes, stage_sizes, worst_stage
from ..sizing.replicas import replica_figures, stage_moe_layers
from ..sizing.state import STRATEGIES, convention, state_dtypes


def _row(label: str, state) -> dict:
    return {"label": label, "params": state.params, "grads": state.grads, "optim": state.optim, "total": state.total}


def crosses_nodes(ranks: list[list[int]], gpus_per_node: int) -> int:
    """The most nodes any one group spans."""
    return max(len({r // gpus_per_node for r in group}) for group in ranks)


def config_plan(cfg, world: int, gpus_per_node: int, gpu_memory_gb: float) -> dict:
    layout = cfg.validate_world(world)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    misfit = fp8_gather_misfit(cfg, layout, layout.dp * layout.cp // p.hsdp_replicas)
    if misfit:  # what the trainer refuses at build time (model/fp8_gather.py), said before launching
        raise UsageError(misfit)
    c = param_counts(m)
    dp_nodes = crosses_nodes(layout.grid.ranks("dp-cp"), gpus_per_node)
    replicas = p.hsdp_replicas if p.hsdp_replicas > 1 else dp_nodes
    stages = stage_sizes(cfg, layout)
    peaks = {s: worst_stage(cfg, layout, stages, s) for _, s in STRATEGIES}
    table = {s: _row(label, peaks[s][2]) for label, s in STRATEGIES}
    if replicas > 1:
        peaks["hsdp"] = worst_stage(cfg, layout, stages, "optim_grads_params", replicas)
        table["hsdp"] = _row(f"HSDP {replicas}x{layout.dp * layout.cp // replicas}", peaks["hsdp"][2])
    budget = budget_bytes(gpu_memory_gb)
    fits = {k: v[0] <= budget for k, v in peaks.items()}
    current = "optim_grads_params" if p.zero == "torch_fsdp2" else p.zero
    _, stage, _, act = peaks[current] if current in peaks else peaks["no_shard"]
    rank = stages[stage][0]
    out = {
        "config": cfg.source, "world": world, "gpus_per_node": gpus_per_node, "gpu_memory_gb": gpu_memory_gb,
        "budget_gb": budget / 1e9, "headroom": HEADROOM,
        "layout": {k: getattr(layout, k) for k in ("tp", "cp", "pp", "vpp", "dp", "ep", "etp", "edp",
                                                   "sequence_parallel", "micro_batch", "microbatches")},
        "params": {"total": c.total, "active": c.active, "mtp": mtp_params(m), "per_rank_dense": rank.dense,
                   "per_rank_experts": rank.experts, "heaviest_stage": stage,
                   "padded_vocab": m.padded_vocab(layout.tp)},
        "model_state": table, "current": p.zero, "convention": convention(t),
        "activations": {"total": act, "stage": stage, "recompute": m.recompute,
                        "sequence_parallel": layout.sequence_parallel, "cp": layout.cp},
        "peak_gb": {k: v[0] / 1e9 for k, v in peaks.items()},
        "flops": {"per_token": training_flops_per_token(m, t.seq_len),
                  "per_step": training_flops_per_step(m, t.seq_len, t.global_batch),
                  "per_rank_per_step": training_flops_per_step(m, t.seq_len, t.global_batch) / world},
        "decision": choose_zero(fits, dp_nodes, layout.dp * layout.cp),
    }
    if not isinstance(m.recompute, str) or m.offload:  # a per-module policy: what it costs per stage
        from .policy import policy_figures

        out["activation_policy"] = policy_figures(cfg, layout)
    if m.is_moe:
        out["experts"] = {"params_per_expert": c.expert, "bytes_per_expert_bf16": 2 * c.expert,
                          "routed_bytes_per_layer_bf16": 2 * c.routed_per_layer, "moe_layers": c.moe_layers,
                          "routed_bytes_all_layers_bf16": 2 * c.routed_per_layer * c.moe_layers,
                          "experts_per_rank_per_layer": m.num_experts // layout.ep, "ep": layout.ep,
                          "bytes_per_rank_per_layer_bf16": 2 * c.expert * (m.num_experts // layout.ep) / layout.etp}
    if m.is_moe and m.expert_balance == "replicate":  # the heaviest stage's replica buffers and bytes
        out["replicas"] = replica_figures(cfg, layout, stage_moe_layers(cfg, layout, stage),
                                          state_dtypes(t)[0].itemsize)
    recurrent = family_of(m).recurrent_state(m, layout, layout.micro_batch, 2 if t.resolved_dtype("cuda") == "bf16" else 4,
                                             p.cp_comm_type)
    if recurrent:  # linear-attention layers: their states and what CP passes (models/<family>/)
        out["recurrent_state"] = recurrent
    if t.fp8 in PAR_FP8:  # par's FP8: its GEMM FLOPs, buffers, gather bytes and amax groups (sizing/fp8.py)
        from ..sizing.fp8 import fp8_figures

        out["fp8"] = fp8_figures(cfg, layout, rank.dense + rank.experts)
    if t.optimizer_declaration.gathers == "matrix":  # which params Muon steps, which AdamW (model/muon_split.py)
        from ..model.muon_split import muon_ns_flops, muon_split

        out["optimizer"] = muon_split(m) | {"ns_flops_per_step": muon_ns_flops(m, t.muon_ns_steps)}
    if t.fault_tolerance == "replica":  # what a replacement receives from a live replica when it rejoins
        from ..sizing.joiner import joiner_bytes

        out["fault_tolerance"] = {"joiner_bytes": joiner_bytes(cfg, layout)}
        if t.buddy_shards:  # the buddy's optimizer shard, and the grads all-reduced where ZeRO-1 reduce-scatters
            from ..sizing.joiner import buddy_costs

            out["fault_tolerance"]["buddy"] = buddy_costs(cfg, layout, stage)
    return out


def choose_zero(fits: dict, dp_nodes: int, d: int) -> dict:
    """The explainer's decision tree over per-rank memory (model state + activations)."""
    for label, strategy in STRATEGIES:
        if not fits[strategy]:
            continue
        if strategy == "optim_grads_params" and dp_nodes > 1 and fits.get("hsdp"):
            return {"zero": "optim_grads_params", "hsdp_replicas": dp_nodes,
                    "why": f"ZeRO-3's dp group spans {dp_nodes} nodes: HSDP with {dp_nodes} replicas of "
                           f"{d // dp_nodes} ranks keeps the per-layer all-gathers inside a node"}
        why = {"no_shard": "the model fits in DDP memory: leave sharding off",
               "optim": "DDP does not fit; sharding the optimizer state (ZeRO-1) does",
               "optim_grads": "ZeRO-1 does not fit; sharding gradients too (ZeRO-2) does",
               "optim_grads_params": "ZeRO-2 does not fit; sharding parameters too (ZeRO-3) does"}[strategy]
        return {"zero": strategy, "hsdp_replicas": 1, "why": why}
    return {"zero": None, "hsdp_replicas": 1,
            "why": "does not fit even with ZeRO-3: raise tp, pp or ep, recompute activations, or use more ranks"}


def _strategy(zero: str) -> str:
    return "optim_grads_params" if zero == "torch_fsdp2" else zero


def choice_cost(plan: dict, seconds: dict | None = None) -> str | None:
    """What the config's ``[parallel].zero`` costs against the decision's, in memory and in the data-parallel
    traffic of a step (planner/estimate.py's ``zero_traffic`` model), and with ``seconds`` ({zero: exposed
    seconds per step}, from a topology) in time; None when they agree."""
    current = _strategy(plan["current"])
    suggested = plan["decision"]["zero"]
    if suggested is None or current == suggested or current not in plan["model_state"]:
        return None
    d, micro = plan["layout"]["dp"] * plan["layout"]["cp"], plan["layout"]["microbatches"]
    grads, params = plan["model_state"]["no_shard"]["grads"], plan["model_state"]["no_shard"]["params"]

    def traffic(zero: str) -> float:  # bytes one rank sends per step in its gradient groups (ring collectives)
        share = (d - 1) / d
        if zero == "no_shard":
            return 2 * share * grads  # all-reduce
        gathers = 1 if zero in ("optim", "optim_grads") else 2 * micro  # ZeRO-3: forward and backward, each micro-batch
        return share * (grads + gathers * params)  # reduce-scatter, then all-gather the bf16 params

    mine, theirs = plan["peak_gb"][current], plan["peak_gb"][suggested]
    sent, base = traffic(current) / 1e9, traffic(suggested) / 1e9
    ratio = sent / base if base else 1.0
    fits = "fits" if mine <= plan["budget_gb"] else "does not fit"
    speed = "no slower" if ratio <= 1 else "slower where the data-parallel reductions are not hidden"
    if seconds:
        when = (f"; exposed on {seconds['topology']}: {seconds[current] * 1e3:.0f} ms vs {seconds[suggested] * 1e3:.0f} ms "
                f"per step")
    else:
        when = "; add --topology PRESET for the exposed time"
    return (f"your zero={plan['current']}: peak {mine:.2f} GB per rank ({fits}) vs {theirs:.2f} GB with zero={suggested} "
            f"({abs(theirs - mine):.2f} GB {'less' if mine <= theirs else 'more'}); data-parallel traffic {sent:.2f} GB vs "
            f"{base:.2f} GB per rank per step ({ratio:.2f}x: {speed}){when}")
