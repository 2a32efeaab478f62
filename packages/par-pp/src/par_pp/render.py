"""Text timeline and JSON of a simulated (or executed) schedule, in the explainer's format:

    Time:   00 01 02 03 04 05 06 07
    GPU 0:  F0 .. .. .. .. .. .. B0

One column per time slot (the largest unit dividing every start and end), cells ``F3``, ``B3``,
``W3`` (kind and microbatch) or ``..`` when idle; an action lasting k slots fills k cells. With
two chunks per rank the later chunk is lower case (``f3``); with more, a letter names the local
chunk (``F3a``, ``F3b``, ...). Cells widen together when labels or slot numbers outgrow two
characters.
"""

from __future__ import annotations

import math
from fractions import Fraction

from .simulate import SimResult

LABEL_WIDTH = 8  # "Time:   " and "GPU 0:  "


def _slot_unit(times: list[float]) -> Fraction:
    """The largest time unit dividing every start and end (1 for integer costs)."""
    fracs = [Fraction(t).limit_denominator(1000) for t in times]
    if not fracs:
        return Fraction(1)
    denominator = math.lcm(*(f.denominator for f in fracs))
    return Fraction(math.gcd(*(int(f * denominator) for f in fracs)), denominator)


def _cell_label(result: SimResult, rank: int, kind: str, microbatch: int, chunk: int) -> str:
    local = result.schedule.chunks_on(rank).index(chunk)
    per_rank = len(result.schedule.chunks_on(rank))
    if per_rank == 1:
        return f"{kind}{microbatch}"
    if per_rank == 2:
        return f"{kind if local == 0 else kind.lower()}{microbatch}"
    return f"{kind}{microbatch}{chr(ord('a') + local)}"


def render_timeline(result: SimResult) -> str:
    times = [t for row in result.ranks for ta in row for t in (ta.start, ta.end) if t > 0]
    unit = _slot_unit(times)
    slots = round(Fraction(result.makespan).limit_denominator(1000) / unit)
    grid: list[list[str | None]] = [[None] * slots for _ in result.ranks]
    for rank, row in enumerate(result.ranks):
        for ta in row:
            a = ta.action
            first = round(Fraction(ta.start).limit_denominator(1000) / unit)
            last = round(Fraction(ta.end).limit_denominator(1000) / unit)
            for s in range(first, last):
                grid[rank][s] = _cell_label(result, rank, a.kind, a.microbatch, a.chunk)
    width = max([2, len(str(max(slots - 1, 0)))] + [len(c) for row in grid for c in row if c])
    lines = ["Time:".ljust(LABEL_WIDTH) + " ".join(str(s).zfill(2).rjust(width) for s in range(slots))]
    for rank, row in enumerate(grid):
        cells = " ".join((c or "..").ljust(width) for c in row)
        lines.append(f"GPU {rank}:".ljust(LABEL_WIDTH) + cells.rstrip())
    return "\n".join(lines)


def timeline_json(result: SimResult) -> dict:
    """``{"makespan", "bubble_fraction", "bubble_fractions", "peak_activations", "ranks": [[{type,
    microbatch, chunk, split, start, end}, ...], ...]}``."""
    return {
        "schedule": result.schedule.name,
        "pp": result.schedule.pp,
        "vpp": result.schedule.vpp,
        "microbatches": result.schedule.microbatches,
        "makespan": result.makespan,
        "bubble_fraction": result.bubble_fraction,
        "bubble_fractions": list(result.bubble_fractions),
        "peak_activations": list(result.peak_activations),
        "ranks": [
            [
                {"type": ta.action.kind, "microbatch": ta.action.microbatch, "chunk": ta.action.chunk, "split": ta.action.split, "start": ta.start, "end": ta.end}
                for ta in row
            ]
            for row in result.ranks
        ],
    }
