"""Bands, the per-step comparison, the one-line verdict and the JSON report.

The allowed difference of a quantity (a step's loss or grad norm, a module output, a parameter
gradient) is ``max(FLOOR, MARGIN x noise)``, where ``noise`` is the reference's own fp32-vs-fp64
distance of that quantity at that step (:mod:`.fp64`), measured, not assumed. MARGIN: the suite's
layouts land at 0.8x-2x of the reference's rounding noise (``tests/layout_runs.py``); FLOOR: 8 units
of fp32's last place (2**-20, 9.5e-7), where the fp64 distance is itself below fp32's resolution
(an embedding lookup, a copy: exact in both).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MARGIN = 4.0
FLOOR = 2.0 ** -20


def band(noise: float, margin: float = MARGIN) -> float:
    return max(FLOOR, margin * noise)


def rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


def judge_step(step: int, result: dict, ref: dict, out_err: dict, grad_err: dict, dims: dict, owners: dict,
               order: list[str], grad_order: list[str], ctx, margin: float, routing: dict | None = None) -> dict:
    """One step's record: loss and grad norm against the reference with their bands, and the first
    tensor out of its band (forward outputs in forward order, then gradients in backward order).

    ``routing`` (:func:`.routing.compare_routing`, None: every MoE layer routed as the reference): a
    near-tie flip is reported and ends the comparison at its router (the loss was held to
    FLIPPED_LOSS_TOLERANCE, the grad norm is only reported); any other difference is the first
    divergence at its MoE layer, unless an output before its router already left its band."""
    from .localise import owning_dimension

    flip = routing if routing is not None and routing["near_tie"] else None
    rec = {"step": step, "loss": result["loss"], "grad_norm": result["grad_norm"],
           "reference_loss": ref["loss"], "reference_grad_norm": ref["grad_norm"]}
    for key, ref_key, noise_key in (("loss", "loss", "loss64"), ("grad_norm", "grad_norm", "norm64")):
        noise = rel(ref[ref_key], ref[noise_key])
        rec[f"{key}_difference"] = rel(result[key], ref[ref_key])
        rec[f"{key}_fp64_noise"] = noise
        rec[f"{key}_band"] = band(noise, margin)
    rec["within_band"] = flip is not None or all(rec[f"{k}_difference"] <= rec[f"{k}_band"] for k in ("loss", "grad_norm"))
    rec["routing"] = routing
    first = None
    for name in order:
        if routing is not None and name == routing["router"]:
            if flip is not None:
                break  # after a near-tie flip the outputs are another computation's
            first = {"kind": "routing", "module": routing["layer"], "tensor": f"{name} (routed pairs per expert)",
                     "moved_pairs": routing["moved_pairs"], "reference_margin": routing["reference_margin"],
                     "why": routing["why"], "relative_error": float("inf"), "band": 0.0,
                     "dimension": owning_dimension(set(), owners.get(routing["layer"]), ctx, grad=False)}
            break
        if name in out_err and out_err[name] > band(ref["noise_out"].get(name, 0.0), margin):
            first = {"kind": "output", "module": name, "tensor": f"{name} (output)", "relative_error": out_err[name],
                     "band": band(ref["noise_out"].get(name, 0.0), margin),
                     "dimension": owning_dimension(dims.get(name, set()), owners.get(name), ctx, grad=False)}
            break
    if first is None and routing is not None and flip is None and routing["router"] not in order:
        first = {"kind": "routing", "module": routing["layer"], "tensor": f"{routing['router']} (routed pairs per expert)",
                 "moved_pairs": routing["moved_pairs"], "reference_margin": routing["reference_margin"],
                 "why": routing["why"], "relative_error": float("inf"), "band": 0.0,
                 "dimension": owning_dimension(set(), owners.get(routing["layer"]), ctx, grad=False)}
    if first is None and flip is None:
        for name in grad_order:
            if name in grad_err and grad_err[name] > band(ref["noise_grad"].get(name, 0.0), margin):
                module = name.rsplit(".", 1)[0]
                first = {"kind": "gradient", "module": module, "tensor": f"{name} (gradient)",
                         "relative_error": grad_err[name], "band": band(ref["noise_grad"].get(name, 0.0), margin),
                         "dimension": owning_dimension(set(), owners.get("param:" + name), ctx, grad=True)}
                break
    rec["tensors_compared"] = {"outputs": len(out_err), "gradients": len(grad_err)}
    rec["first_divergence"] = first
    rec["certified"] = rec["within_band"] and first is None
    return rec


def verdict_line(steps: list[dict], layout: str) -> tuple[str, int]:
    """(line, exit code): ``certified: ...`` 0, ``NOT certified: ...`` 3."""
    bad = [s for s in steps if not s["certified"]]
    flipped = [s for s in steps if s.get("routing") and s["routing"]["near_tie"]]
    compared = [s for s in steps if s not in flipped] or steps
    worst_loss = max(s["loss_difference"] for s in compared)
    worst_norm = max(s["grad_norm_difference"] for s in compared)
    if not bad:
        flips = "".join(f"; step {s['step']}: MoE routing flipped at a near-tie at {s['routing']['layer']} "
                        f"({s['routing']['moved_pairs']} pair(s) moved, the reference's smallest top-k margin "
                        f"{s['routing']['reference_margin']:.1e}, loss difference {s['loss_difference']:.1e}), "
                        f"reported, not compared at the band" for s in flipped)
        return (f"certified: {layout} trains the same model as one rank over {len(steps)} fp32 steps "
                f"(max relative difference loss {worst_loss:.1e}, grad norm {worst_norm:.1e}; every step within "
                f"{MARGIN:g}x the reference's fp32-vs-fp64 noise{flips})"), 0
    s = bad[0]
    f = s["first_divergence"]
    if f is not None and f["kind"] == "routing":
        where = (f"first divergence at MoE layer {f['module']}: its routed (token, expert) pairs per expert differ "
                 f"from the reference's ({f['why']}), dimension {f['dimension']}")
    elif f is None:
        where = (f"loss differs by {s['loss_difference']:.1e} (band {s['loss_band']:.1e}), grad norm by "
                 f"{s['grad_norm_difference']:.1e} (band {s['grad_norm_band']:.1e}); no single tensor was out of its band")
    else:
        where = (f"first divergence at module {f['module']}, tensor {f['tensor']}, relative error "
                 f"{f['relative_error']:.1e} (band {f['band']:.1e}), dimension {f['dimension']}")
    return f"NOT certified: {layout} at step {s['step']}: {where}", 3


def write_report(path: Path, layout: str, overrides: list[str], steps: list[dict], line: str, code: int,
                 vocabulary: dict | None = None) -> None:
    """``vocabulary``: the ids written into every step's batch (:mod:`.coverage`)."""
    from ..runtime.safe_files import write_atomic

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    report = {"verdict": line, "certified": code == 0, "layout": layout, "margin": MARGIN, "floor": FLOOR,
              "overrides": overrides, "vocabulary_ids": vocabulary, "steps": steps}
    write_atomic(path, json.dumps(clean(report), indent=1) + "\n", fsync=False)
