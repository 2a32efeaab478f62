"""`pretrain plan MODEL --world N --topology PRESET --auto [--json]`: the best layouts, explained.

Prints the five fastest layouts (each shape's best ZeRO strategy, micro-batch size and
recompute) with per-rank memory, estimated step time and its parts, the MFU that step time
implies, and why each lost to the first, then the assumptions behind the estimate.
"""

from __future__ import annotations

import dataclasses
import time

from ..config import apply_overrides, config_from_dict
from ..errors import UsageError
from ..observe.metrics import lookup_peak_tflops
from ..runtime.rank_assignment import described_topology
from .choice_time import topology_spec
from .estimate import ASSUMPTIONS, OFFLOAD_ASSUMPTION, Cluster
from ..sizing.memory import HEADROOM, budget_bytes, stage_sizes, worst_stage
from .search import Choice, search, shape_config

GB = 1e9


ESTIMATED = ("estimated: pretrain.sizing's closed form of the heaviest stage, the figures `plan --simulate` "
             "is tested against (model state within 1 %, activations within 10 %); add --simulate to measure "
             "the first choice")


def auto_plan(cfg, world: int, topology: str, efficiency: float = 0.6, peak_tflops: float = 0.0,
              top: int = 5, simulate: bool = False, on_phase=lambda rank, phase: None, policies: bool = False) -> dict:
    """Search and rank; a dict ready for JSON (``best`` holds the ``top`` layouts). ``simulate``: run
    the heaviest stage of the top choices on fake tensors (:func:`check_by_simulation`) before
    calling one a fit; those measured over the budget leave the list."""
    spec = topology_spec(topology)
    if not 0 < efficiency <= 1:
        raise UsageError(f"--efficiency {efficiency:g} must be in (0, 1]: achieved / peak FLOP/s of the compute")
    topo = described_topology(dataclasses.replace(cfg, topology=spec), world)
    cluster = Cluster(spec, len(topo.node_ranks()[0]), topo.largest_domain(), topo.bandwidth["pcie"])
    gpu = topo.gpus[0]
    tflops = peak_tflops or lookup_peak_tflops(gpu.name, "bf16")
    if not tflops:
        raise UsageError(f"no known peak for {gpu.name!r}; give --peak-tflops (bf16 dense TFLOP/s per GPU)")
    budget = budget_bytes(gpu.memory_gb)
    start = time.perf_counter()
    found, tried = search(cfg, world, budget, tflops * 1e12, efficiency, cluster, policies)
    seconds = time.perf_counter() - start
    if not found:
        raise UsageError(f"no layout of {cfg.source or 'the config'} fits {world} x {gpu.memory_gb:g} GB "
                         f"({tried} shapes tried): use more GPUs or a smaller global batch / sequence")
    checks = check_by_simulation(cfg, world, found, gpu.memory_gb, on_phase, tries=top) if simulate else []
    measured = {c["index"]: c["measured_gb"] for c in checks if c["fits"]}
    rows = [(c, measured.get(i)) for i, c in enumerate(found) if i in measured or i not in {x["index"] for x in checks}]
    if not rows:
        raise UsageError(f"every layout simulated measured over {budget / GB:.1f} GB: see `plan --simulate`")
    note = "" if not checks or checks[-1]["fits"] else (
        f"none of the {len(checks)} simulated fits: the layouts below are unmeasured estimates, which "
        f"underestimated those; check one with `plan --simulate` before training")
    return {
        "model": cfg.source, "world": world, "topology": topo.describe(),
        "memory_check": {"method": "simulated" if checks else "estimated", "simulated": checks,
                         "note": note if checks else ESTIMATED},
        "assumptions": {"peak_tflops": tflops, "efficiency": efficiency, "memory_budget_gb": budget / GB,
                        "headroom": HEADROOM, "seq_len": cfg.train.seq_len, "global_batch": cfg.train.global_batch,
                        "notes": list(ASSUMPTIONS) + ([OFFLOAD_ASSUMPTION] if policies else []) + fp8_notes(cfg)},
        "shapes_tried": tried, "shapes_fitting": len(found), "search_seconds": seconds,
        "best": [row(c, rows[0][0], cfg) | {"measured_gb": gb} for c, gb in rows[:top]],
    }


def fp8_notes(cfg) -> list[str]:
    """Under par's FP8: its GEMMs' share of the compute at FP8's rate (sizing/fp8.py), MFU against bf16's peak."""
    from ..sizing.fp8 import FP8_RATE, fp8_compute_time

    time = fp8_compute_time(cfg.model, cfg.train)
    if time == 1.0:
        return []
    return [f"[train].fp8={cfg.train.fp8!r}: the FP8 GEMMs at {FP8_RATE:g}x the peak, the rest at it (compute "
            f"{time:.2f}x bf16's); MFU counts the model's FLOPs against the bf16 peak"]


def choice_config(cfg, c: Choice):
    """``cfg`` with the choice's layout, as `pretrain train` gets it from the printed --set flags."""
    flags = overrides(c, cfg).replace("--set ", "").replace("'", "").split()  # the shell's quotes off
    return config_from_dict(apply_overrides(cfg.to_dict(), flags), cfg.source)


def check_by_simulation(cfg, world: int, found: list[Choice], gpu_memory_gb: float, on_phase, tries: int = 5) -> list[dict]:
    """`plan --simulate` of each top choice's heaviest stage (its tp, cp, dp rank 0), in order, until one
    fits: a layout is only called a fit once the trainer's own step has been measured on it."""
    from ..simulate.report import simulate

    checks = []
    for index, c in enumerate(found[:tries]):
        chosen = choice_config(cfg, c)
        layout = chosen.validate_world(world)
        _, stage, _, _ = worst_stage(chosen, layout, stage_sizes(chosen, layout), chosen.parallel.zero)
        rank = layout.grid.ranks("pp")[0][stage]
        r = simulate(chosen, world, [rank], gpu_memory_gb=gpu_memory_gb, on_phase=on_phase)["ranks"][0]
        checks.append({"index": index, "set": overrides(c, cfg), "rank": rank, "stage": stage, "estimated_gb": c.memory / GB,
                       "measured_gb": r["measured_peak"] / GB, "fits": r["fits"]})
        if r["fits"]:
            break
    return checks


def layout_of(c: Choice) -> dict:
    s = c.shape
    return {"tp": s.tp, "cp": s.cp, "pp": s.pp, "vpp": s.vpp, "schedule": s.schedule, "dp": s.dp, "ep": s.ep,
            "etp": s.etp, "edp": s.edp, "zero": c.zero, "micro_batch": c.micro_batch,
            "microbatches": c.microbatches,
            "recompute": c.recompute if isinstance(c.recompute, str) else list(c.recompute), "first_stage_layers": s.first,
            "last_stage_layers": s.last} | ({"offload": list(c.offload)} if c.offload else {})


def overrides(c: Choice, cfg) -> str:
    """The layout as the `--set` flags `pretrain train` takes on ``cfg``: every [parallel] key the
    search set to other than ``cfg``'s value, then zero, micro-batch and recompute."""
    s, base = c.shape, cfg.parallel
    chosen = shape_config(cfg, s).parallel
    out = [f"parallel.{f.name}={_literal(getattr(chosen, f.name))}" for f in dataclasses.fields(chosen)
           if f.name not in ("zero", "sequence_parallel") and getattr(chosen, f.name) != getattr(base, f.name)]
    if s.tp > 1 and base.sequence_parallel is False:  # the search plans sequence parallelism with tp
        out.append("parallel.sequence_parallel=true")
    out += [f"parallel.zero={c.zero}", f"train.micro_batch={c.micro_batch}", f"model.recompute={_recompute_literal(c.recompute)}"]
    if c.offload != cfg.model.offload:
        out.append(f"model.offload={_recompute_literal(c.offload)}")
    return " ".join(f"--set {o}" for o in out)


def _recompute_literal(value) -> str:
    """A word as it is; a module list (or [model].offload's) as a quoted TOML list the shell hands over whole."""
    return value if isinstance(value, str) else "'[" + ",".join(f'"{v}"' for v in value) + "]'"


def _literal(value) -> str:
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def parts(c: Choice) -> dict[str, float]:
    e = c.estimate
    return {"compute": e.compute_s, "bubble": e.bubble_s, **{f"{n} comm": v for n, v in e.comm_s.items()}}


def why_lost(c: Choice, first: Choice) -> str:
    """The parts of the step time that make ``c`` slower than ``first``, largest first."""
    if c is first:
        return "fastest"
    mine, theirs = parts(c), parts(first)
    delta = {k: mine.get(k, 0.0) - theirs.get(k, 0.0) for k in set(mine) | set(theirs)}
    worse = sorted((d, k) for k, d in delta.items() if d > 0)[::-1][:3]
    gap = c.estimate.step_s - first.estimate.step_s
    if gap <= 1e-9 * first.estimate.step_s:
        return "ties with the first, which is simpler (less sharding, recompute or parallelism)"
    text = ", ".join(f"{k} +{_ms(d)}" + _link_note(c, k) for d, k in worse)
    return f"{_ms(gap)} slower ({100 * gap / first.estimate.step_s:.1f} %): {text}"


def _link_note(c: Choice, part: str) -> str:
    name = part.removesuffix(" comm")
    return f" ({name} over {c.links[name]})" if part.endswith(" comm") and name in c.links else ""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms"


def row(c: Choice, first: Choice, cfg) -> dict:
    e = c.estimate
    return {"layout": layout_of(c), "set": overrides(c, cfg), "memory_gb": c.memory / GB, "step_s": e.step_s,
            "compute_s": e.compute_s, "bubble_s": e.bubble_s, "comm_s": dict(e.comm_s), "mfu": e.mfu,
            "links": dict(c.links), "why": why_lost(c, first)}


def render(plan: dict) -> str:
    a = plan["assumptions"]
    lines = [f"{plan['model']} on {plan['world']} GPUs: {plan['topology']}",
             f"searched {plan['shapes_tried']} shapes ({plan['shapes_fitting']} fit {a['memory_budget_gb']:.0f} GB = "
             f"GPU memory less {a['headroom']:.0%}) in {plan['search_seconds']:.1f} s; peak {a['peak_tflops']:g} "
             f"TFLOP/s x efficiency {a['efficiency']:g}; seq {a['seq_len']}, global batch {a['global_batch']}", ""]
    for i, r in enumerate(plan["best"], 1):
        lay = r["layout"]
        shape = " ".join(f"{k}={lay[k]}" for k in ("tp", "cp", "pp", "dp", "ep") if lay[k] > 1 or k == "dp")
        if lay["ep"] > 1:
            shape += f" etp={lay['etp']} edp={lay['edp']}"
        if lay["pp"] > 1:
            shape += f" {lay['schedule']}" + (f" vpp={lay['vpp']}" if lay["vpp"] > 1 else "")
            if lay["first_stage_layers"]:
                shape += f" stages {lay['first_stage_layers']}|..|{lay['last_stage_layers']}"
        comm = sum(r["comm_s"].values())
        offload = f", offload={lay['offload']}" if lay.get("offload") else ""
        lines.append(f"{i}. {shape}, zero={lay['zero']}, recompute={lay['recompute']}{offload}, micro-batch {lay['micro_batch']} x "
                     f"{lay['microbatches']}: {r['memory_gb']:.1f} GB"
                     f"{'' if r.get('measured_gb') is None else ' (measured %.1f GB)' % r['measured_gb']}, step {r['step_s']:.3g} s (compute "
                     f"{r['compute_s']:.3g} + bubble {r['bubble_s']:.3g} + exposed comm {comm:.3g}), MFU {r['mfu']:.1%}")
        lines.append(f"   {r['why']}")
        lines.append(f"   {r['set']}")
    check = plan["memory_check"]
    lines += ["", "memory: " + (check["note"] if check["method"] == "estimated" else "simulated (the trainer's step "
              "on fake tensors) before calling a layout a fit" + (f"; {check['note']}" if check["note"] else "") + ":")]
    for c in check["simulated"]:
        lines.append(f"  {c['set']}: rank {c['rank']} (pp stage {c['stage']}) measured {c['measured_gb']:.2f} GB, "
                     f"estimated {c['estimated_gb']:.2f} GB: {'fits' if c['fits'] else 'does NOT fit (dropped)'}")
    lines += ["", "assumptions:"] + [f"  - {note}" for note in a["notes"]]
    return "\n".join(lines)
