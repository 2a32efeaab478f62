"""The fault-tolerance events of a run's ``log.jsonl`` (``replica_lost``, ``replica_joined``), for ``pretrain report``."""

from __future__ import annotations

import json
from pathlib import Path

EVENTS = ("replica_lost", "replica_joined")


def log_events(log_dir: Path) -> list[dict]:
    """Every event line of ``<log_dir>/log.jsonl`` in order (a string ``event`` and an int ``step``; other
    lines, damaged ones included, are skipped)."""
    out = []
    for line in (log_dir / "log.jsonl").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str) and type(record.get("step")) is int:
            out.append(record)
    return out


def replica_events(log_dir: Path) -> list[dict]:
    """Every replica event of ``<log_dir>/log.jsonl`` in order."""
    return [r for r in log_events(log_dir) if r["event"] in EVENTS]


def describe(event: dict) -> str:
    """One summary line: which replica, at which step, how long the job stood still, what moved."""
    ranks = ", ".join(map(str, event.get("ranks", [])))
    still = event.get("stood_still_s")
    still = f"; stood still {still:.2f} s" if type(still) in (int, float) else ""
    if event["event"] == "replica_lost":
        return f"after step {event['step']}: replica {event.get('replica', '?')} lost (ranks {ranks}){still}"
    moved = event.get("bytes_moved")
    moved = f", {moved:,} bytes moved to it" if type(moved) is int else ""
    return f"after step {event['step']}: replica {event.get('replica', '?')} rejoined (ranks {ranks}){moved}{still}"
