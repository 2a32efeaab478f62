"""`pretrain plan`: what a config costs per rank, before launching anything.

Model state follows the explainer's conventions (bf16 params and grads, fp32 Adam moments, no fp32
master copy: 2 + 2 + 8 bytes per parameter; fp32 training: 4 + 4 + 8) through par-zero's memory
model; dense state is sharded over the dp x cp group, expert state over expert dp. Activations
and FLOPs come from :mod:`pretrain.flops`. The decision tree is the explainer's: DDP if it fits,
then ZeRO-1, then ZeRO-2 / ZeRO-3, then HSDP when a ZeRO-3 dp group crosses nodes.
"""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from par_zero import model_state

from ..config import Config, Layout, load_config
from ..errors import UsageError, fail
from ..flops import activation_bytes, mtp_params, param_counts, training_flops_per_step, training_flops_per_token

GB, MB = 1e9, 1e6
STRATEGIES = (("DDP", "no_shard"), ("ZeRO-1", "optim"), ("ZeRO-2", "optim_grads"), ("ZeRO-3", "optim_grads_params"))
CONVENTION = "bf16 params and grads, fp32 Adam moments, no master copy"


def num(x: float) -> str:
    """84.0 -> '84', 22.75 -> '22.75', 10.5 -> '10.5'."""
    return f"{round(x, 2):g}"


def human_bytes(b: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", GB), ("MB", MB), ("KB", 1e3)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def human_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def bytes_per_param(dtype: str) -> tuple[int, int, int]:
    return (4, 4, 8) if dtype == "fp32" else (2, 2, 8)


def state_table(dense_params: float, expert_params: float, d: int, ed: int, dtype: str,
                replicas: int = 1, expert_replicas: int = 1) -> dict:
    """Per-rank bytes for each strategy: dense params sharded over ``d``, expert params over ``ed``.

    With ``replicas`` > 1 an HSDP row is added: ZeRO-3 inside ``d / replicas`` ranks (experts:
    ``ed / expert_replicas``), replicated across the replicas."""
    p, g, o = bytes_per_param(dtype)
    out = {}
    for label, strategy in STRATEGIES:
        parts = [model_state(n * p, n * g, n * o, strategy, size) for n, size in ((dense_params, d), (expert_params, ed))]
        out[strategy] = {"label": label, "params": sum(s.params for s in parts), "grads": sum(s.grads for s in parts),
                         "optim": sum(s.optim for s in parts), "total": sum(s.total for s in parts)}
    if replicas > 1:
        inner = [max(d // replicas, 1), max(ed // expert_replicas, 1)]
        parts = [model_state(n * p, n * g, n * o, "optim_grads_params", h, outer=r)
                 for n, h, r in zip((dense_params, expert_params), inner, (replicas, expert_replicas))]
        out["hsdp"] = {"label": f"HSDP {replicas}x{inner[0]}", "params": sum(s.params for s in parts),
                       "grads": sum(s.grads for s in parts), "optim": sum(s.optim for s in parts),
                       "total": sum(s.total for s in parts)}
    return out


def params_only_plan(num_params: float, dp: int) -> dict:
    return {"params": num_params, "dp": dp, "convention": CONVENTION,
            "model_state_gb": {k: v["total"] / GB for k, v in state_table(num_params, 0, dp, 1, "bf16").items()},
            "detail": state_table(num_params, 0, dp, 1, "bf16")}


def stage_params(cfg: Config, layout: Layout) -> tuple[float, float, int]:
    """(dense params, routed expert params, stage index) on the rank of the heaviest pipeline stage."""
    m, c = cfg.model, param_counts(cfg.model)
    best = (0.0, 0.0, 0)
    for stage, layers in enumerate(cfg.parallel.stage_layers(m.layers)):
        experts_extra = 0.0
        moe = sum(m.is_moe_layer(i) for i in layers)
        dense = c.attention * len(layers) + c.dense_mlp * (len(layers) - moe) + (c.router + c.shared_experts) * moe
        if stage == 0:
            dense += c.embedding
        if stage == layout.pp - 1:
            dense += c.output + c.final_norm + (c.embedding if m.tie_embeddings and layout.pp > 1 else 0)
            mtp_routed = sum(m.is_moe_layer(j) for j in range(m.layers, m.layers + m.mtp_depth)) * c.routed_per_layer
            dense += mtp_params(m) - mtp_routed  # the MTP modules sit with the output head
            experts_extra = mtp_routed / layout.ep / layout.etp
        experts = moe * (c.num_experts // layout.ep) * c.expert / layout.etp + experts_extra
        candidate = (dense / layout.tp, experts, stage)
        if candidate[0] + candidate[1] > best[0] + best[1]:
            best = candidate
    return best


def crosses_nodes(ranks: list[list[int]], gpus_per_node: int) -> int:
    """The most nodes any one group spans."""
    return max(len({r // gpus_per_node for r in group}) for group in ranks)


def config_plan(cfg: Config, world: int, gpus_per_node: int, gpu_memory_gb: float) -> dict:
    layout = cfg.validate_world(world)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    dtype = "fp32" if t.dtype == "fp32" else "bf16"
    c = param_counts(m)
    dense, experts, stage = stage_params(cfg, layout)
    grid = layout.grid
    dp_nodes = crosses_nodes(grid.ranks("dp-cp"), gpus_per_node)
    edp_nodes = crosses_nodes(grid.expert_ranks("dp"), gpus_per_node)
    table = state_table(dense, experts, layout.dp * layout.cp, layout.edp, dtype,
                        replicas=p.hsdp_replicas if p.hsdp_replicas > 1 else dp_nodes,
                        expert_replicas=p.hsdp_replicas if p.hsdp_replicas > 1 else edp_nodes)
    act = activation_bytes(m, seq_len=t.seq_len, micro_batch=layout.micro_batch, tp=layout.tp, cp=layout.cp,
                           pp=layout.pp, vpp=layout.vpp, etp=layout.etp, sequence_parallel=layout.sequence_parallel,
                           schedule=p.schedule, microbatches=layout.microbatches, dtype_bytes=4 if dtype == "fp32" else 2,
                           first_stage_layers=len(p.stage_layers(m.layers)[0]))
    budget = gpu_memory_gb * GB
    fits = {k: v["total"] + act.total <= budget for k, v in table.items()}
    decision = decide(fits, dp_nodes, layout.dp * layout.cp, table)
    out = {
        "config": cfg.source, "world": world, "gpus_per_node": gpus_per_node, "gpu_memory_gb": gpu_memory_gb,
        "layout": {k: getattr(layout, k) for k in ("tp", "cp", "pp", "vpp", "dp", "ep", "etp", "edp",
                                                   "sequence_parallel", "micro_batch", "microbatches")},
        "params": {"total": c.total, "active": c.active, "mtp": mtp_params(m), "per_rank_dense": dense, "per_rank_experts": experts,
                   "heaviest_stage": stage},
        "model_state": table, "current": p.zero, "convention": CONVENTION if dtype == "bf16" else "fp32 params and grads, fp32 Adam moments",
        "activations": {"dense_layer": act.dense_layer, "moe_layer": act.moe_layer, "per_microbatch": act.per_microbatch,
                        "in_flight": act.in_flight, "logits": act.logits, "total": act.total,
                        "recompute": m.recompute, "sequence_parallel": layout.sequence_parallel, "cp": layout.cp},
        "flops": {"per_token": training_flops_per_token(m, t.seq_len),
                  "per_step": training_flops_per_step(m, t.seq_len, t.global_batch),
                  "per_rank_per_step": training_flops_per_step(m, t.seq_len, t.global_batch) / world},
        "decision": decision,
    }
    if m.is_moe:
        out["experts"] = {"params_per_expert": c.expert, "bytes_per_expert_bf16": 2 * c.expert,
                          "routed_bytes_per_layer_bf16": 2 * c.routed_per_layer, "moe_layers": c.moe_layers,
                          "routed_bytes_all_layers_bf16": 2 * c.routed_per_layer * c.moe_layers,
                          "experts_per_rank_per_layer": m.num_experts // layout.ep, "ep": layout.ep,
                          "bytes_per_rank_per_layer_bf16": 2 * c.expert * (m.num_experts // layout.ep) / layout.etp}
    return out


def decide(fits: dict, dp_nodes: int, d: int, table: dict) -> dict:
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


def render_params_only(plan: dict) -> str:
    lines = [f"model state per rank for {plan['params']:g} params at dp={plan['dp']} ({plan['convention']}):"]
    for strategy, row in plan["detail"].items():
        lines.append(f"  {row['label'] + ' (' + strategy + ')':30} {num(row['total'] / GB):>8} GB   params "
                     f"{num(row['params'] / GB)} + grads {num(row['grads'] / GB)} + optimizer {num(row['optim'] / GB)}")
    return "\n".join(lines)


def render_config(plan: dict) -> str:
    lay, prm, act, fl = plan["layout"], plan["params"], plan["activations"], plan["flops"]
    lines = [
        f"{plan['config']} on {plan['world']} ranks ({plan['gpus_per_node']} per node, {num(plan['gpu_memory_gb'])} GB each)",
        "layout: " + " ".join(f"{k}={lay[k]}" for k in ("tp", "cp", "pp", "vpp", "dp", "ep", "etp", "edp"))
        + f" sp={'on' if lay['sequence_parallel'] else 'off'}; {lay['microbatches']} micro-batch(es) of {lay['micro_batch']} per dp rank",
        f"params: {human_count(prm['total'])} total, {human_count(prm['active'])} active per token"
        + (f" (+ {human_count(prm['mtp'])} in the MTP modules)" if prm["mtp"] else "") + "; per rank (stage "
        f"{prm['heaviest_stage']}): {human_count(prm['per_rank_dense'])} dense + {human_count(prm['per_rank_experts'])} experts",
    ]
    if "experts" in plan:
        e = plan["experts"]
        lines.append(f"experts: {human_count(e['params_per_expert'])} params = {human_bytes(e['bytes_per_expert_bf16'])} (bf16) "
                     f"each; {human_bytes(e['routed_bytes_per_layer_bf16'])} routed per MoE layer, "
                     f"{human_bytes(e['routed_bytes_all_layers_bf16'])} over {e['moe_layers']} layers; ep={e['ep']}: "
                     f"{e['experts_per_rank_per_layer']} experts per rank per layer "
                     f"({human_bytes(e['bytes_per_rank_per_layer_bf16'])})")
    lines.append(f"model state per rank ({plan['convention']}):")
    for strategy, row in plan["model_state"].items():
        mark = " <- current" if strategy == plan["current"] else ""
        lines.append(f"  {row['label'] + ' (' + strategy + ')':30} {human_bytes(row['total']):>10}   params "
                     f"{human_bytes(row['params'])} + grads {human_bytes(row['grads'])} + optimizer "
                     f"{human_bytes(row['optim'])}{mark}")
    lines.append(f"activations per rank: {human_bytes(act['total'])} (recompute={act['recompute']}, sp "
                 f"{'on' if act['sequence_parallel'] else 'off'}, cp={act['cp']}; per layer {human_bytes(act['dense_layer'])} dense"
                 + (f" / {human_bytes(act['moe_layer'])} MoE" if "experts" in plan else "")
                 + f", {num(act['in_flight'])} micro-batch(es) in flight, logits {human_bytes(act['logits'])})")
    lines.append(f"FLOPs: {fl['per_step']:.3e} per step ({fl['per_token']:.3e} per token, {fl['per_rank_per_step']:.3e} per rank)")
    d = plan["decision"]
    choice = "none fits" if d["zero"] is None else f"zero={d['zero']}" + (
        f", hsdp_replicas={d['hsdp_replicas']}" if d["hsdp_replicas"] > 1 else "")
    lines.append(f"decision: {choice}: {d['why']}")
    return "\n".join(lines)


def plan(
    config: Optional[str] = typer.Argument(None, help="TOML config or shipped name (default: the embedded tiny.toml)."),
    overrides: List[str] = typer.Option([], "--set", help="Override a key: --set parallel.tp=2 (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    world: Optional[int] = typer.Option(None, "--world", help="Number of ranks (default: [train].nproc)."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="Ranks per node (for HSDP and node crossings)."),
    gpu_memory: float = typer.Option(80.0, "--gpu-memory", help="Memory per GPU in GB for the decision tree."),
    params: Optional[float] = typer.Option(None, "--params", help="Model-state-only form: number of parameters."),
    dp: Optional[int] = typer.Option(None, "--dp", help="Model-state-only form: data-parallel size."),
    auto: bool = typer.Option(False, "--auto", help="Search the layouts for --world GPUs of --topology; print the best 5."),
    topology: Optional[str] = typer.Option(None, "--topology", help="With --auto: a topology preset (dgx-h100 ...) or a compact TOML description."),
    efficiency: float = typer.Option(0.6, "--efficiency", help="With --auto: achieved / peak FLOP/s of the compute."),
    peak_tflops: float = typer.Option(0.0, "--peak-tflops", help="With --auto: bf16 TFLOP/s per GPU (default: known GPUs)."),
    simulate: bool = typer.Option(False, "--simulate", help="Run the real training step of one rank on fake tensors "
                                  "and report measured memory and collectives beside the plan."),
    ranks: List[int] = typer.Option([], "--rank", help="With --simulate: the rank(s) to simulate (default: first, "
                                    "middle and last pipeline stage)."),
    imbalance: float = typer.Option(1.0, "--expert-imbalance", help="With --simulate: one expert gets F times its share."),
    all_microbatches: bool = typer.Option(False, "--all-microbatches", help="With --simulate: run every micro-batch "
                                          "(default: enough to reach the schedule's memory peak)."),
) -> None:
    """Per-rank memory (model state per ZeRO strategy, activations, experts), FLOPs and the ZeRO decision."""
    try:
        if auto:
            from ..planner.auto import auto_plan, render

            if world is None or topology is None:
                raise UsageError("--auto needs --world N and --topology PRESET, e.g. --world 64 --topology dgx-h100")
            result = auto_plan(load_config(config, overrides), world, topology, efficiency, peak_tflops)
            typer.echo(json.dumps(result) if as_json else render(result))
            return
        if params is not None or dp is not None:
            if params is None or dp is None:
                raise UsageError("the model-state-only form needs both --params and --dp, e.g. --params 7e9 --dp 8")
            if config is not None or overrides or world is not None:
                raise UsageError("--params/--dp plan model state alone; leave out CONFIG, --set and --world")
            if params <= 0 or dp < 1:
                raise UsageError(f"--params {params:g} must be > 0 and --dp {dp} >= 1")
            result = params_only_plan(params, dp)
            typer.echo(json.dumps(result) if as_json else render_params_only(result))
            return
        if gpus_per_node < 1 or gpu_memory <= 0:
            raise UsageError(f"--gpus-per-node {gpus_per_node} must be >= 1 and --gpu-memory {gpu_memory:g} > 0")
        cfg = load_config(config, overrides)
        if simulate or ranks:
            from ..simulate.report import render as render_simulation, simulate as run_simulation

            if not simulate:
                raise UsageError("--rank selects ranks for --simulate; add --simulate")
            sim = run_simulation(cfg, world if world is not None else cfg.train.nproc, ranks, imbalance, all_microbatches)
            typer.echo(json.dumps(sim) if as_json else render_simulation(sim))
            return
        result = config_plan(cfg, world if world is not None else cfg.train.nproc, gpus_per_node, gpu_memory)
    except UsageError as e:
        raise fail(str(e))
    typer.echo(json.dumps(result) if as_json else render_config(result))
