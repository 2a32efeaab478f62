"""Reading the ranks' flight records (``CommWatch.record``) together: who waits where, and for whom.

Every rank numbers its calls on each group (``seq``), so the ranks waiting in call ``#k`` of a
group wait for the group's members whose last call there is earlier than ``#k`` (or who left no
record at all: stopped, dead, or stuck outside any collective). :func:`summarize` says so in one
line; ``notes`` adds what is known about a rank from outside (e.g. "process stopped (SIGSTOP)").
"""

from __future__ import annotations

from dataclasses import dataclass


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _call(e: dict) -> str:
    if e["peer"] is not None:
        return f"{e['op']} {'to' if e['op'] == 'send' else 'from'} rank {e['peer']} on {e['group']}"
    return f"{e['op']} #{e['seq']} on {e['group']} (ranks {_ranks(e['ranks'])}, {e['bytes']:,} B)"


def _last_seq(record: dict, entry: dict) -> int:
    """``record``'s rank's last call number on ``entry``'s group (0: none in its ring)."""
    seqs = [e["seq"] for e in record["entries"] if e["peer"] is None and e.get("group_id") == entry.get("group_id")
            and e["group"] == entry["group"] and e["ranks"] == entry["ranks"]]
    return max(seqs, default=0)


def _missing(entry: dict, records: dict[int, dict | None]) -> list[int]:
    """The ranks ``entry`` waits for: its group's members, or its peer, that have not reached it."""
    if entry["peer"] is not None:
        peer = records.get(entry["peer"])
        in_flight = peer and peer.get("in_flight")
        matched = in_flight and in_flight["peer"] is not None and in_flight["op"] != entry["op"]
        return [] if matched else [entry["peer"]]
    return [r for r in entry["ranks"] if records.get(r) is None or _last_seq(records[r], entry) < entry["seq"]]


def _where(rank: int, records: dict[int, dict | None], notes: dict[int, str]) -> str:
    record = records.get(rank)
    if record is None:
        return f"rank {rank} ({notes.get(rank, 'no flight record: stopped, dead, or stuck outside a collective')})"
    if record.get("in_flight"):
        return f"rank {rank} (waiting in {_call(record['in_flight'])} instead)"
    at = f" at {record['where']}" if record.get("where") else ""
    return f"rank {rank} (in no collective{at})"


@dataclass(frozen=True)
class Hang:
    line: str  # which ranks wait in which call, and which have not arrived
    rank: int | None  # the first rank that has not arrived (None: every member reached the call)


def summarize(records: dict[int, dict | None], world: int, notes: dict[int, str] | None = None) -> Hang | None:
    """The collective the ranks wait in and the ranks that have not arrived, from every rank's
    record (None where a rank left none); None when no rank was waiting."""
    notes = notes or {}
    waits: dict[tuple, list[int]] = {}
    first: dict[tuple, dict] = {}
    for rank in range(world):
        entry = (records.get(rank) or {}).get("in_flight")
        if entry:
            key = (entry["op"], entry.get("group_id"), entry["group"], tuple(entry["ranks"]), entry["seq"], entry["peer"])
            waits.setdefault(key, []).append(rank)
            first.setdefault(key, entry)
    if not waits:
        return None

    def blame(key) -> tuple:  # calls held up by a rank that waits for nothing first, then the most waiters
        missing = _missing(first[key], records)
        roots = [r for r in missing if not (records.get(r) or {}).get("in_flight")]
        return bool(roots), bool(missing), len(waits[key])

    key = max(waits, key=blame)
    entry, waiting = first[key], waits[key]
    missing = _missing(entry, records)
    who = "; ".join(_where(r, records, notes) for r in missing) or "none (every member reached it)"
    waiters = f"ranks {_ranks(waiting)} wait" if len(waiting) > 1 else f"rank {waiting[0]} waits"
    return Hang(f"{waiters} in {_call(entry)}; not arrived: {who}", missing[0] if missing else None)
