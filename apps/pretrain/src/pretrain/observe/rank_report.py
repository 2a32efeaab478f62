"""Per-rank lines of ``pretrain report``: each rank's busy time, the straggler rule's flags, the
pipeline stages' imbalance and the silent-corruption verdicts, from a run's ``log.jsonl``."""

from __future__ import annotations

import statistics
from pathlib import Path

from .replica_events import log_events

SHOWN = 16  # ranks listed by busy time; beyond, the slowest of them


def _numbers(values) -> bool:
    return isinstance(values, list) and bool(values) and all(type(v) in (int, float) for v in values)


def rank_lines(log_dir: Path, train: list[dict]) -> list[str]:
    lines = []
    rows = [r["time_busy_by_rank_s"] for r in train if _numbers(r.get("time_busy_by_rank_s"))]
    rows = [r for r in rows if len(r) == len(rows[-1])] if rows else []
    if rows:
        busy = [statistics.median(column) for column in zip(*rows)]
        order = sorted(range(len(busy)), key=lambda r: -busy[r])[:SHOWN]
        shown = ", ".join(f"r{r} {1e3 * busy[r]:.0f}" for r in sorted(order))
        more = f" (the {SHOWN} slowest of {len(busy)})" if len(busy) > SHOWN else ""
        lines.append(f"busy per rank, median ms{more}: {shown}")
    stages = [r["stage_busy_s"] for r in train if _numbers(r.get("stage_busy_s"))]
    if stages and all(len(s) == len(stages[-1]) for s in stages):
        lines.append("busy per pipeline stage, median ms (imbalance, not stragglers): "
                     + ", ".join(f"{1e3 * statistics.median(c):.0f}" for c in zip(*stages)))
    flags: dict[int, list[dict]] = {}
    events = log_events(log_dir)
    for e in events:
        if e["event"] == "straggler" and type(e.get("rank")) is int:
            flags.setdefault(e["rank"], []).append(e)
    for rank, fired in sorted(flags.items()):
        phases = statistics.multimode(e.get("phase") for e in fired)
        worst = max((e["slower"] for e in fired if type(e.get("slower")) in (int, float)), default=None)
        lines.append(f"straggler rank {rank} (host {fired[-1].get('host', '?')}, GPU {fired[-1].get('gpu', '?')}): "
                     f"flagged at {len(fired)} log step{'s' * (len(fired) != 1)} (steps {fired[0]['step']}-"
                     f"{fired[-1]['step']}), mostly in {', '.join(map(str, phases))}"
                     + (f", up to {worst:.1f}x its peers" if worst is not None else "")
                     + (", chronic" if any(e.get("chronic") for e in fired) else ""))
    for e in events:
        if e["event"] == "corruption":
            lines.append(f"step {e['step']}: corruption check: {e.get('class', '?')} on rank {e.get('rank', '?')} "
                         f"(host {e.get('host', '?')}, GPU {e.get('gpu', '?')})")
        elif e["event"] == "stage_imbalance":
            lines.append(f"step {e['step']}: stage imbalance: stage {e.get('stage', '?')} busy {e.get('ratio', '?')}x "
                         f"stage {e.get('fastest', '?')} (planned {e.get('planned_ratio', '?')}x, by layers)")
        elif e["event"] == "copies_differ":
            lines.append(f"step {e['step']}: copies of {e.get('key', '?')} differ between ranks "
                         f"{', '.join(map(str, e.get('ranks', [])))}")
    checks = [e for e in events if e["event"] == "integrity_check"]
    if checks:
        lines.append(f"{len(checks)} copies check{'s' * (len(checks) != 1)}: median "
                     f"{1e3 * statistics.median(e.get('hash_s', 0) for e in checks):.1f} ms, "
                     f"{checks[-1].get('hashed_bytes', 0):,} bytes hashed and "
                     f"{checks[-1].get('hash_bytes', 0):,} bytes of hashes gathered per rank")
    return lines
