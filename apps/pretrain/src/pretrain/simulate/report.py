"""``pretrain plan CONFIG --world N --simulate``: simulate ranks, print measured beside planned."""

from __future__ import annotations

import dataclasses
import time

from par_moe import DeclaredRouting

from .plan_replicas import plural, render_replicas
from ..errors import UsageError
from ..sizing.memory import budget_bytes
from .collectives import compare, step_collectives
from .run import check_rank, default_roles, simulate_rank

GB = 1e9
SHOWN = ("params", "grads", "optim", "activations")


def simulated_config(cfg, layout, all_microbatches: bool):
    """The config the simulation runs, and (micro-batches simulated, per step).

    Without ``all_microbatches`` a pipeline runs the fewest micro-batches that reach its schedule's
    memory peak (1F1B: pp, whose stage s holds pp - s; other schedules 2 x pp; GPipe keeps all),
    which is what bounds the time on a small machine. When ZeRO-2/3 shard the gradients, one more:
    their full gradient buffer is alive from the first backward on, so the peak needs a forward
    after a backward (pp = 1: two micro-batches)."""
    if cfg.train.dtype == "auto":  # simulate what a GPU run does: bf16
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype="bf16"))
    # the configured rank order (finding a topology all-gathers NVML views, which fake ranks lack)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, rank_assignment="off"))
    m = layout.microbatches
    if all_microbatches or cfg.parallel.schedule == "gpipe":
        keep = m
    else:
        per_stage = 1 if layout.pp == 1 or cfg.parallel.schedule == "1f1b" else 2
        grads_sharded = cfg.parallel.zero in ("optim_grads", "optim_grads_params")
        keep = min(m, per_stage * layout.pp + (1 if grads_sharded and per_stage == 1 else 0))
    if keep == m:
        return cfg, keep, m
    train = dataclasses.replace(cfg.train, global_batch=keep * layout.dp * layout.micro_batch)
    parallel = dataclasses.replace(cfg.parallel, microbatches=keep if cfg.parallel.microbatches else 0)
    return dataclasses.replace(cfg, train=train, parallel=parallel), keep, m


def simulate(cfg, world: int, ranks: list[int], imbalance: float = 1.0, all_microbatches: bool = False,
             gpu_memory_gb: float = 80.0, on_phase=lambda rank, phase: None) -> dict:
    """Simulate ``ranks`` (default: :func:`default_roles`); each is judged against the memory budget of a
    GPU of ``gpu_memory_gb`` (less the headroom). ``on_phase(rank, phase)``: progress, as each phase starts."""
    layout = cfg.validate_world(world)
    if imbalance < 1.0:
        raise UsageError(f"--expert-imbalance {imbalance:g} must be >= 1 (1 = balanced routing)")
    m = cfg.model
    if m.is_moe and imbalance > m.num_experts / m.top_k:
        raise UsageError(f"--expert-imbalance {imbalance:g} is more than an expert can receive (every token once): "
                         f"use 1..{m.num_experts / m.top_k:g} ([model].num_experts / top_k)")
    for r in ranks:
        check_rank(r, world)
    sim_cfg, kept, total = simulated_config(cfg, layout, all_microbatches)
    sim_layout = sim_cfg.validate_world(world)
    budget = budget_bytes(gpu_memory_gb)
    out = {"config": cfg.source, "world": world, "routing": routing_note(cfg, imbalance),
           "microbatches": {"simulated": kept, "per_step": total}, "gpu_memory_gb": gpu_memory_gb,
           "budget_gb": budget / GB, "ranks": []}
    roles = {r: ["chosen"] for r in ranks} if ranks else default_roles(cfg, layout)
    for rank, why in roles.items():
        t0 = time.perf_counter()
        r = simulate_rank(sim_cfg, world, rank, imbalance, on_phase=lambda phase, rank=rank: on_phase(rank, phase))
        r["fits"], r["planned_fits"] = r["measured_peak"] <= budget, r["planned_peak"] <= budget
        routing = DeclaredRouting(imbalance) if cfg.model.is_moe else None
        theory = step_collectives(sim_cfg, sim_layout, r["stage"], kept, routing, r["coords"].get("ep", 0))
        r["collectives"] = compare(r["collectives"], theory)
        r["timings_s"]["total_s"] = time.perf_counter() - t0
        r["roles"] = why
        out["ranks"].append(r)
    return out


def routing_note(cfg, imbalance: float) -> str:
    """What the run assumed for the token counts that real routing takes from the data."""
    if not cfg.model.is_moe:
        return "dense: no expert routing"
    share = "balanced: every expert receives top_k/num_experts of each rank's tokens" if imbalance == 1 else (
        f"expert 0 (EP rank 0) receives {imbalance:g} x its share, the others the rest evenly")
    return f"declared routing, not the data's: {share}; a token's experts on distinct EP ranks"


def _pct(measured: float, planned: float) -> str:
    return f"{100 * (measured - planned) / planned:+.1f}%" if planned else "n/a"


def render(result: dict) -> str:
    mb = result["microbatches"]
    lines = [f"simulated {plural(len(result['ranks']), 'rank')} of world {result['world']} on fake tensors "
             f"({result['routing']}); {mb['simulated']} of {mb['per_step']} micro-batches per step"
             + (" (the schedule's peak is reached; --all-microbatches runs them all)" if mb["simulated"] < mb["per_step"] else "")]
    for r in result["ranks"]:
        layers = r["layers"]
        roles = "" if r.get("roles", ["chosen"]) == ["chosen"] else f" [{', '.join(r['roles'])}]"
        lines.append(f"rank {r['rank']} (pp stage {r['stage']}{roles}, layers {layer_ranges(layers)}, {plural(len(layers), 'layer')}): "
                     f"peak {r['measured_peak'] / GB:.2f} GB measured, {r['planned_peak'] / GB:.2f} GB planned; "
                     f"build peak {r['build_peak'] / GB:.2f} GB; checkpoint save peak {r['save_peak'] / GB:.2f} GB; "
                     f"{r['timings_s']['total_s']:.0f} s")
        for k in SHOWN:  # activations include the temporaries alive at the peak
            lines.append(f"  {k:12} {r['measured'][k] / GB:9.2f} GB measured  {r['planned'][k] / GB:9.2f} GB planned  "
                         f"{_pct(r['measured'][k], r['planned'][k])}")
        lines.append(f"  {'other':12} {r['measured']['other'] / GB:9.2f} GB measured (RoPE tables, buffers; not planned)")
        if "replicas" in r:
            lines.append("  " + render_replicas(r["replicas"]))
        if "offloaded" in r:  # [model].offload's copies (host memory: not in the device's figures above)
            o = r["offloaded"]
            lines.append(f"  offload      {o['out'] / GB:9.3f} GB out and {o['back'] / GB:.3f} GB back measured, "
                         f"{o['planned'] / GB:.3f} GB planned (the simulated micro-batches)")
        for c in r["collectives"]:
            want = "" if c["theory_bytes"] is None else f"  theory {c['theory_bytes'] / GB:.3f} GB ({_pct(c['bytes'], c['theory_bytes'])})"
            kinds = "".join(f"; {k} {v / GB:.3f} GB" for k, v in c.get("by_dtype", {}).items())
            lines.append(f"  {c['op']:14} {c['group']:8} x{c['count']:<5} {c['bytes'] / GB:10.3f} GB{want}{kinds}")
    for r in result["ranks"]:
        lines.append(verdict(r, result["budget_gb"], result["gpu_memory_gb"]))
    return "\n".join(lines)


def verdict(r: dict, budget_gb: float, gpu_memory_gb: float) -> str:
    """One line: does the rank's measured peak fit the budget (and does the plan agree)."""
    agree = "the plan agrees" if r["fits"] == r["planned_fits"] else (
        f"the plan ({r['planned_peak'] / GB:.2f} GB) says it {'fits' if r['planned_fits'] else 'does not'}")
    return (f"rank {r['rank']}: {'fits' if r['fits'] else 'does NOT fit'}: {r['measured_peak'] / GB:.2f} GB measured "
            f"against {budget_gb:.1f} GB ({gpu_memory_gb:g} GB GPU less the headroom); {agree}")


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 77, 78, 79] -> '0..2 + 77..79' (a V schedule's rank holds two runs of layers)."""
    runs, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[i - 1] + 1:
            runs.append(f"{layers[start]}..{layers[i - 1]}" if i - 1 > start else f"{layers[start]}")
            start = i
    return " + ".join(runs)
