"""`pretrain schedule`: simulate a pipeline schedule and print its timeline, bubble and memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from par_pp import build_schedule, parse_costs, render_timeline, simulate, timeline_json

from ..errors import fail

MAX_CELLS = 1 << 16  # pp x chunks x microbatches: the timeline of 65536 passes still prints in seconds


def _caption(name: str, pp: int, vpp: int, microbatches: int, costs) -> str:
    full = costs.b + costs.w if costs.full_backward is None else costs.full_backward
    virtual = f", VPP={vpp}" if vpp > 1 else ""
    comm = "communication time omitted" if costs.p2p == 0 else f"p2p latency {costs.p2p:g}"
    return f"{name}: PP={pp}{virtual}, M={microbatches}; F={costs.f:g}, full B={full:g}, split B={costs.b:g}, W={costs.w:g} slots; {comm}."


def schedule(
    pp: int = typer.Option(..., "--pp", help="Pipeline ranks."),
    microbatches: int = typer.Option(..., "--microbatches", help="Microbatches per optimizer step."),
    schedule_name: str = typer.Option("1f1b", "--schedule", help="gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev."),
    vpp: int = typer.Option(1, "--vpp", help="Chunks per rank (interleaved; zb-v and dualpipev always use 2)."),
    costs: str = typer.Option("", "--costs", help="Slot costs, e.g. f=1,b=1,w=1 (keys f, b, w, full, p2p). A full B costs one slot unless b/w are given, then b+w."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also draw the timeline to this PNG (needs matplotlib)."),
) -> None:
    """Print a pipeline schedule's timeline (the explainer's format), bubble fraction and peak activations."""
    if pp * max(vpp, 2) * microbatches > MAX_CELLS:
        raise fail(f"--pp {pp} x --vpp {vpp} x --microbatches {microbatches} is more than {MAX_CELLS:,} chunk passes "
                   f"to simulate and draw; use fewer microbatches (the bubble fraction settles after a few x pp)")
    try:
        plan = build_schedule(schedule_name, pp, microbatches, vpp)
        slot_costs = parse_costs(costs)
    except ValueError as e:
        raise fail(str(e)) from None
    result = simulate(plan, slot_costs)
    if png is not None:
        from ..errors import UsageError
        from ..observe.plots import schedule_png

        if not png.parent.is_dir():
            raise fail(f"--png {str(png)!r}: the directory {str(png.parent)!r} does not exist")
        try:
            schedule_png(timeline_json(result), _caption(plan.name, pp, plan.vpp, microbatches, slot_costs)
                         + f" Bubble {result.bubble_fraction:.3f}.", png)
        except UsageError as e:
            raise fail(str(e))
    if as_json:
        typer.echo(json.dumps(timeline_json(result)))
        return
    per_rank = " ".join(f"{b:.3f}" for b in result.bubble_fractions)
    typer.echo(_caption(plan.name, pp, plan.vpp, microbatches, slot_costs))
    legend = {1: "", 2: "; lower case = each rank's second chunk"}.get(plan.vpp, "; a, b, c... = each rank's chunks in model order")
    typer.echo(".. = idle" + legend)
    typer.echo("")
    typer.echo(render_timeline(result))
    typer.echo("")
    typer.echo(f"makespan: {result.makespan:g} slots")
    typer.echo(f"bubble fraction: {result.bubble_fraction:.3f} (per rank: {per_rank})")
    typer.echo("peak activations per rank: " + " ".join(str(n) for n in result.peak_activations))
