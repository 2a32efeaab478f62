"""`pretrain plan`: the CLI of the planner (per-rank costs, `--auto`'s search, `--simulate`).

The figures come from :mod:`pretrain.planner` and :mod:`pretrain.sizing`; this module parses and prints.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..config import load_config
from ..errors import UsageError, fail
from ..planner.costs import choice_cost, config_plan
from ..planner.state_only import TRAINER_BYTES, params_only_plan
from ..simulate.plan_replicas import human_bytes, plural, render_replicas

GB, MB = 1e9, 1e6


def num(x: float) -> str:
    """84.0 -> '84', 22.75 -> '22.75', 10.5 -> '10.5'."""
    return f"{round(x, 2):g}"


def gb(b: float) -> str:
    """Bytes in GB whatever their size, so the rows of one table compare at a glance: 501.91e6 -> '0.50 GB'."""
    return f"{b / GB:.2f} GB"


def human_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def render_params_only(plan: dict) -> str:
    lines = [f"model state per rank for {plan['params']:g} params at dp={plan['dp']} ({plan['convention']}):"]
    for key, row in plan["detail"].items():
        tag = f"h={plan['dp'] // plan['hsdp_replicas']}" if key == "hsdp" else key
        pct = f"{round(100 * row['fraction'], 1):g}"
        lines.append(f"  {row['label'] + ' (' + tag + ')':30} {num(row['total'] / GB):>8} GB {pct:>5} % of DDP   params "
                     f"{num(row['params'] / GB)} + grads {num(row['grads'] / GB)} + optimizer {num(row['optim'] / GB)}")
    return "\n".join(lines)


def state_only_plan(params: float, dp: int, bytes_pgo: tuple, hsdp_replicas: Optional[int]) -> dict:
    """``params_only_plan`` after checking the values (a :class:`UsageError` for a bad one)."""
    if not (math.isfinite(params) and params > 0) or dp < 1:
        raise UsageError(f"--params {params:g} must be a finite number > 0 and --dp {dp} >= 1")
    p, g, o = bytes_pgo
    if not (math.isfinite(p) and p > 0):
        raise UsageError(f"--param-bytes {p:g} must be a finite number > 0")
    for name, b in (("grad", g), ("optim", o)):
        if not (math.isfinite(b) and b >= 0):
            raise UsageError(f"--{name}-bytes {b:g} must be a finite number >= 0")
    if hsdp_replicas is not None and (hsdp_replicas < 1 or dp % hsdp_replicas):
        raise UsageError(f"--hsdp-replicas {hsdp_replicas} must be >= 1 and divide --dp {dp}")
    return params_only_plan(params, dp, bytes_pgo, hsdp_replicas)


def render_config(plan: dict, seconds: dict | None = None) -> str:
    lay, prm, act, fl = plan["layout"], plan["params"], plan["activations"], plan["flops"]
    moe = "experts" in plan  # expert dims, active params and expert bytes mean nothing for a dense model
    dims = ("tp", "cp", "pp", "vpp", "dp") + (("ep", "etp", "edp") if moe else ())
    mtp = f" (+ {human_count(prm['mtp'])} in the MTP modules)" if prm["mtp"] else ""
    per_rank = f"per rank (stage {prm['heaviest_stage']}): {human_count(prm['per_rank_dense'])}"
    lines = [
        f"{plan['config']} on {plural(plan['world'], 'rank')} ({plan['gpus_per_node']} per node, {num(plan['gpu_memory_gb'])} GB each)",
        "layout: " + " ".join(f"{k}={lay[k]}" for k in dims)
        + f" sp={'on' if lay['sequence_parallel'] else 'off'}; "
        f"{plural(lay['microbatches'], 'micro-batch', 'micro-batches')} of {lay['micro_batch']} per dp rank",
        f"params: {human_count(prm['total'])} total, {human_count(prm['active'])} active per token{mtp}; {per_rank} dense + "
        f"{human_count(prm['per_rank_experts'])} experts" if moe else
        f"params: {human_count(prm['total'])} total{mtp}; {per_rank}",
    ]
    if "experts" in plan:
        e = plan["experts"]
        lines.append(f"experts: {human_count(e['params_per_expert'])} params = {human_bytes(e['bytes_per_expert_bf16'])} (bf16) "
                     f"each; {human_bytes(e['routed_bytes_per_layer_bf16'])} routed per MoE layer, "
                     f"{human_bytes(e['routed_bytes_all_layers_bf16'])} over {plural(e['moe_layers'], 'layer')}; ep={e['ep']}: "
                     f"{e['experts_per_rank_per_layer']} experts per rank per layer "
                     f"({human_bytes(e['bytes_per_rank_per_layer_bf16'])})")
    if "replicas" in plan:
        lines.append(render_replicas(plan["replicas"]))
    if "optimizer" in plan:
        from ..model.muon_split import render_split

        lines.append(render_split(plan["optimizer"]))
    if "fault_tolerance" in plan:
        lines.append(f"fault tolerance (replica): a replacement receives {human_bytes(plan['fault_tolerance']['joiner_bytes'])} "
                     f"per rank from the live replica (fp32 masters and optimizer state it owns)")
        if "buddy" in plan["fault_tolerance"]:
            b = plan["fault_tolerance"]["buddy"]
            params = f", {human_bytes(b['param_bytes'])} more params (its param shard)" if "param_bytes" in b else ""
            lines.append(f"buddy shards: {human_bytes(b['optim_bytes'])} more optimizer state per rank (the next rank's "
                         f"shard){params}, {human_bytes(b['grad_bytes_per_step'])} more gradient bytes per step (all-reduce "
                         f"in place of reduce-scatter)" + (f", {human_bytes(b['muon_bytes_per_step'])} more bytes of Muon's "
                                                           f"orthogonalized updates per step (all-reduced too)" if "muon_bytes_per_step" in b else ""))
    lines.append(f"model state per rank ({plan['convention']}); peak = with the activations, heaviest stage, "
                 f"against {num(plan['budget_gb'])} GB (GPU memory less {plan['headroom']:.0%}):")
    for strategy, row in plan["model_state"].items():
        mark = " <- current" if strategy == plan["current"] else ""
        peak = plan["peak_gb"][strategy]
        lines.append(f"  {row['label'] + ' (' + strategy + ')':30} {gb(row['total']):>10}   params "
                     f"{gb(row['params'])} + grads {gb(row['grads'])} + optimizer "
                     f"{gb(row['optim'])}; peak {gb(peak * GB)} {'fits' if peak <= plan['budget_gb'] else 'does not fit'}{mark}")
    lines.append(f"activations per rank: {human_bytes(act['total'])} on pp stage {act['stage']} (recompute="
                 f"{act['recompute']}, sp {'on' if act['sequence_parallel'] else 'off'}, cp={act['cp']})")
    for st in plan.get("activation_policy", {}).get("stages", []):  # a per-module recompute or offload
        lines.append(f"  stage {st['stage']}: activations {human_bytes(st['activations'])}, recomputed "
                     f"{st['recompute_flops_per_step']:.3e} FLOPs per rank per step ({st['recompute_flops_per_step'] / st['model_flops_per_step']:.1%} "
                     f"of its model FLOPs), offloaded {human_bytes(st['offloaded_bytes_per_step'])} per step, host-to-device "
                     f"{st['h2d_gb_s_needed']:.1f} GB/s needed at {plan['activation_policy']['assumed_tflops']:g} TFLOP/s")
    if "recurrent_state" in plan:  # linear-attention layers (the family declares them)
        r = plan["recurrent_state"]
        lines.append(f"  {r['linear_layers']} linear-attention layers, each per micro-batch: state "
                     f"{human_bytes(r['state_bytes'])}, the scan keeps {human_bytes(r['scan_saved_bytes_per_token'])} "
                     f"and the conv {human_bytes(r['conv_saved_bytes_per_token'])} per token for backward"
                     + (f"; CP passes {human_bytes(r['cp_state_bytes_per_layer'])} of states and "
                        f"{human_bytes(r['cp_halo_bytes_per_layer'])} of conv halo" if r["cp_boundaries_per_rank"] else ""))
    lines.append(f"FLOPs: {fl['per_step']:.3e} per step ({fl['per_token']:.3e} per token, {fl['per_rank_per_step']:.3e} per rank)")
    if "fp8" in plan:
        from ..sizing.fp8 import render_fp8

        lines.append(render_fp8(plan["fp8"]))
    d = plan["decision"]
    choice = "none fits" if d["zero"] is None else f"zero={d['zero']}" + (
        f", hsdp_replicas={d['hsdp_replicas']}" if d["hsdp_replicas"] > 1 else "")
    lines.append(f"decision: {choice}: {d['why']}")
    cost = choice_cost(plan, seconds)
    if cost:
        lines.append(cost)
    return "\n".join(lines)


PHASES = {"build": "building its model and DP wrapper", "step": "running one training step",
          "save": "building its checkpoint tensors"}


@contextmanager
def simulation_progress():
    """``on_phase(rank, phase)`` showing what the simulation does, on stderr: a rich spinner on a
    terminal, else one line per phase (a simulation of a large model takes tens of seconds)."""
    console = Console(stderr=True)
    start = time.perf_counter()
    if not console.is_terminal:
        yield lambda rank, phase: print(f"simulating rank {rank}: {PHASES[phase]} ({time.perf_counter() - start:.0f} s)",
                                        file=sys.stderr, flush=True)
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("simulating", total=None)
        yield lambda rank, phase: bar.update(task, description=f"simulating rank {rank}: {PHASES[phase]}")


def check_options(options: dict, open_low: tuple = ()) -> None:
    """Each given ``name: (value, low, high)`` a finite number in range (``open_low``: above low), else one line."""
    for name, (value, low, high) in options.items():
        if value is None:
            continue
        ok = math.isfinite(value) and (value > low if name in open_low else value >= low) and value <= high
        if not ok:
            raise UsageError(f"{name} {value:g} must be a finite number in {'(' if name in open_low else '['}{low:g}, "
                             f"{high:g}]")


def plan(
    config: Optional[str] = typer.Argument(None, help="TOML config or shipped name (default: the embedded tiny.toml)."),
    overrides: List[str] = typer.Option([], "--set", help="Override a key: --set parallel.tp=2 (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    world: Optional[int] = typer.Option(None, "--world", help="Number of ranks (default: [train].nproc)."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="Ranks per node (for HSDP and node crossings)."),
    gpu_memory: float = typer.Option(80.0, "--gpu-memory", help="Memory per GPU in GB (the budget is 90 % of it): "
                                     "the decision tree's and --simulate's fits / does not fit."),
    params: Optional[float] = typer.Option(None, "--params", help="Model-state-only form: number of parameters."),
    dp: Optional[int] = typer.Option(None, "--dp", help="Model-state-only form: data-parallel size."),
    param_bytes: Optional[float] = typer.Option(None, "--param-bytes", help="With --params: bytes per parameter of "
                                                "the parameters (default 2: bf16)."),
    grad_bytes: Optional[float] = typer.Option(None, "--grad-bytes", help="With --params: bytes per parameter of the "
                                               "gradients (default 4: fp32)."),
    optim_bytes: Optional[float] = typer.Option(None, "--optim-bytes", help="With --params: bytes per parameter of the "
                                                "optimizer state (default 12: fp32 main weights + two Adam moments)."),
    hsdp_replicas: Optional[int] = typer.Option(None, "--hsdp-replicas", help="With --params: add HSDP's row, ZeRO-3 "
                                                "inside h = dp / N ranks, N replicas (1/h of DDP)."),
    auto: bool = typer.Option(False, "--auto", help="Search the layouts for --world GPUs of --topology; print the best 5 "
                              "(with --simulate: measure the first choice's heaviest stage before calling it a fit)."),
    topology: Optional[str] = typer.Option(None, "--topology", help="With --auto: a topology preset (dgx-h100 ...) or a compact TOML description; without: "
                                          "the exposed time of a [parallel].zero other than the decision's."),
    auto_policy: bool = typer.Option(False, "--auto-policy", help="With --auto: search per-module recompute lists "
                                     "([model].recompute = [\"core_attn\", \"mlp\", ...]) beside none, selective and full."),
    efficiency: float = typer.Option(0.6, "--efficiency", help="With --auto: achieved / peak FLOP/s of the compute."),
    peak_tflops: float = typer.Option(0.0, "--peak-tflops", help="With --auto: bf16 TFLOP/s per GPU (default: known GPUs)."),
    simulate: bool = typer.Option(False, "--simulate", help="Run the real training step of one rank on fake tensors "
                                  "and report measured memory and collectives beside the plan."),
    ranks: List[int] = typer.Option([], "--rank", help="With --simulate: the rank(s) to simulate (default: the first, "
                                    "middle and last pipeline stage and the plan's heaviest by memory and by time)."),
    imbalance: float = typer.Option(1.0, "--expert-imbalance", help="With --simulate: one expert gets F times its share."),
    all_microbatches: bool = typer.Option(False, "--all-microbatches", help="With --simulate: run every micro-batch "
                                          "(default: enough to reach the schedule's memory peak)."),
) -> None:
    """Per-rank memory (model state per ZeRO strategy, activations, experts), FLOPs and the ZeRO decision."""
    try:
        check_options({"--gpus-per-node": (gpus_per_node, 1, 1 << 12), "--gpu-memory": (gpu_memory, 0, 1e6),
                       "--params": (params, 0, 1e16), "--dp": (dp, 1, 1 << 17), "--efficiency": (efficiency, 0, 1),
                       "--peak-tflops": (peak_tflops, 0, 1e7), "--expert-imbalance": (imbalance, 1, 1e9)},
                      open_low=("--gpu-memory", "--params", "--efficiency"))
        bytes_given = (param_bytes, grad_bytes, optim_bytes)
        if params is None and dp is None and any(v is not None for v in (*bytes_given, hsdp_replicas)):
            raise UsageError("--param-bytes, --grad-bytes, --optim-bytes and --hsdp-replicas go with --params N --dp D "
                             "(a config's come from [train] and [parallel].hsdp_replicas)")
        if auto_policy and not auto:
            raise UsageError("--auto-policy widens --auto's search; add --auto (and --world, --topology)")
        if auto:
            from ..planner.auto import auto_plan, render

            if world is None or topology is None:
                raise UsageError("--auto needs --world N and --topology PRESET, e.g. --world 64 --topology dgx-h100")
            if ranks:
                raise UsageError("--auto --simulate picks the rank to simulate (each choice's heaviest stage); drop --rank")
            with simulation_progress() as on_phase:
                result = auto_plan(load_config(config, overrides), world, topology, efficiency, peak_tflops,
                                   simulate=simulate, on_phase=on_phase, policies=auto_policy)
            typer.echo(json.dumps(result) if as_json else render(result))
            return
        if params is not None or dp is not None:
            if params is None or dp is None:
                raise UsageError("the model-state-only form needs both --params and --dp, e.g. --params 7e9 --dp 8")
            if config is not None or overrides or world is not None:
                raise UsageError("--params/--dp plan model state alone; leave out CONFIG, --set and --world")
            bytes_pgo = tuple(default if v is None else v for v, default in zip(bytes_given, TRAINER_BYTES))
            result = state_only_plan(params, dp, bytes_pgo, hsdp_replicas)
            typer.echo(json.dumps(result) if as_json else render_params_only(result))
            return
        if gpus_per_node < 1 or gpu_memory <= 0:
            raise UsageError(f"--gpus-per-node {gpus_per_node} must be >= 1 and --gpu-memory {gpu_memory:g} > 0")
        cfg = load_config(config, overrides)
        if simulate or ranks:
            from ..simulate.report import render as render_simulation, simulate as run_simulation

            if not simulate:
                raise UsageError("--rank selects ranks for --simulate; add --simulate")
            with simulation_progress() as on_phase:
                sim = run_simulation(cfg, world if world is not None else cfg.train.nproc, ranks, imbalance,
                                     all_microbatches, gpu_memory, on_phase)
            typer.echo(json.dumps(sim) if as_json else render_simulation(sim))
            return
        result = config_plan(cfg, world if world is not None else cfg.train.nproc, gpus_per_node, gpu_memory)
        seconds = None
        zeros = [result["current"], result["decision"]["zero"]]
        if topology is not None and not as_json and zeros[1] is not None and zeros[0] != zeros[1]:
            from ..planner.choice_time import exposed_dp_seconds

            zeros[0] = "optim_grads_params" if zeros[0] == "torch_fsdp2" else zeros[0]
            seconds = exposed_dp_seconds(cfg, result["world"], topology, zeros) | {"topology": topology}
    except UsageError as e:
        raise fail(str(e))
    typer.echo(json.dumps(result) if as_json else render_config(result, seconds))
