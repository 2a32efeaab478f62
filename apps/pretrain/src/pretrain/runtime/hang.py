"""A hang names itself: each rank's flight recorder, and the launcher's one-line summary of them.

In a rank (:func:`flight_recorder`): a :class:`par_groups.watch.CommWatch` over the whole run. A
collective that raises (gloo's timeout after ``[train].collective_timeout_s``, or a peer gone) writes the
rank's record, ``<log.dir>/flight/rank_R.json``: its last collectives (op, group, sequence
number, bytes) and its Python stack. SIGUSR1 writes it too, from wherever the rank is.

In the launcher (:func:`hang_summary`), once a rank failed on a timeout: ranks that wrote no
record yet get SIGUSR1 and a few seconds; a stopped process (``SIGSTOP``, state T) or a dead one
is noted as such; ``par_groups.flight.summarize`` names the ranks waiting, the collective, and
the rank that has not arrived. ``pretrain hang LOG_DIR`` (:func:`summary_of_dir`) prints the same
line from the records alone, for runs another launcher started (torchrun). On CUDA, NCCL's own flight recorder is turned on as well
(``TORCH_NCCL_TRACE_BUFFER_SIZE``, dumps on timeout to ``flight/nccl_rank_R``), unless set.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from par_groups.flight import Hang, summarize
from par_groups.watch import CommWatch

from ..errors import UsageError
from ..config.layout import MAX_WORLD

FLIGHT_DIR = "flight"
RECORD_WAIT_S = 3.0  # how long the launcher waits for the records of ranks it sent SIGUSR1
TIMEOUT_WORDS = ("timed out", "timeout", "time out")


def record_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / FLIGHT_DIR / f"rank_{rank}.json"


def nccl_flight_env(log_dir: str | Path) -> dict[str, str]:
    """NCCL's flight recorder settings (set before the process group exists; the user's win)."""
    base = Path(log_dir).resolve() / FLIGHT_DIR / "nccl_rank_"
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(base)}
    return {k: v for k, v in wanted.items() if k not in os.environ}


def flight_recorder(log_dir: str | Path, rank: int, capacity: int) -> CommWatch:
    """This rank's watch (enter it around the run), its stale record removed, SIGUSR1 dumping it."""
    path = record_path(log_dir, rank)
    path.unlink(missing_ok=True)
    watch = CommWatch(capacity, dump_path=path)

    def on_usr1(signum, frame) -> None:
        in_flight = next((e for e in reversed(watch.entries) if e.end is None and e.waiting_since), None)
        watch.dump("SIGUSR1 from the launcher", in_flight, frame)

    try:
        signal.signal(signal.SIGUSR1, on_usr1)
    except ValueError:  # not the main thread: records on errors only
        pass
    return watch


def is_timeout(error: str) -> bool:
    return any(w in error.lower() for w in TIMEOUT_WORDS)


def _state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, T = stopped ...); None when it is gone or unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


ENTRY_FIELDS = {"seq": int, "op": str, "group": str, "ranks": list, "bytes": int}


def _entry_ok(entry) -> bool:
    return (isinstance(entry, dict) and all(type(entry.get(k)) is t for k, t in ENTRY_FIELDS.items())
            and all(type(r) is int and 0 <= r < MAX_WORLD for r in entry["ranks"])
            and (entry.get("peer") is None or (type(entry["peer"]) is int and 0 <= entry["peer"] < MAX_WORLD))
            and isinstance(entry.get("group_id", ""), str))


def well_formed(record) -> bool:
    """Whether ``record`` has the shape a flight recorder writes (what the summary reads), ranks below MAX_WORLD."""
    if not (isinstance(record, dict) and type(record.get("rank")) is int and 0 <= record["rank"] < MAX_WORLD):
        return False
    entries, in_flight = record.get("entries", []), record.get("in_flight")
    return (type(record.get("time", 0)) in (int, float) and isinstance(record.get("where", ""), str)
            and isinstance(entries, list) and all(_entry_ok(e) for e in entries)
            and (in_flight is None or _entry_ok(in_flight)))


def _load(path: Path):
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def _read(path: Path, since: float) -> dict | None:
    record = _load(path)
    return record if well_formed(record) and record.get("time", 0) >= since else None


def _world(records: dict[int, dict]) -> int:
    """The run's size as far as the records tell: the highest rank any of them names, plus one."""
    seen = set(records)
    for record in records.values():
        for entry in record.get("entries", []) + [record.get("in_flight") or {}]:
            seen |= set(entry.get("ranks", [])) | ({entry["peer"]} if entry.get("peer") is not None else set())
    return max(seen) + 1


def summary_of_dir(log_dir: str | Path, notes: dict[int, str] | None = None) -> tuple[Hang | None, int]:
    """``pretrain hang``: the summary of the records in ``<log_dir>/flight`` (whoever launched the
    run, e.g. torchrun) and how many records there were. A rank without one is named as such; a file
    that is not a flight record (not JSON, another shape) is a UsageError naming it. ``notes``: what is known
    of ranks without one (a dead rank's heartbeat, :func:`pretrain.runtime.dead_rank.notes_of_dir`)."""
    records = {}
    for path in sorted((Path(log_dir) / FLIGHT_DIR).glob("rank_*.json")):
        record = _load(path)
        if not well_formed(record):
            raise UsageError(f"{path} is not a flight record pretrain wrote (not JSON, or not a rank's record of "
                             f"its collectives); move it away and run `pretrain hang` again")
        records[record["rank"]] = record
    if not records:
        return None, 0
    return summarize(records, _world(records), notes), len(records)


def hang_summary(log_dir: str | Path, pids: list[int], since: float) -> Hang | None:
    """Collect the ranks' records written after ``since`` (asking for missing ones) and summarize."""
    world = len(pids)
    records = {r: _read(record_path(log_dir, r), since) for r in range(world)}
    notes: dict[int, str] = {}
    asked = []
    for rank, pid in enumerate(pids):
        state = _state(pid)
        if records[rank] is not None:
            continue
        if state is None or state in "ZX":
            notes[rank] = "process exited without a flight record"
        elif state in "Tt":
            notes[rank] = "process stopped (SIGSTOP), no flight record"
        else:
            try:
                os.kill(pid, signal.SIGUSR1)
                asked.append(rank)
            except ProcessLookupError:  # exited just now
                notes[rank] = "process exited without a flight record"
    deadline = time.monotonic() + RECORD_WAIT_S
    while asked and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank in list(asked):
            records[rank] = _read(record_path(log_dir, rank), since)
            if records[rank] is not None:
                asked.remove(rank)
    for rank in asked:
        notes[rank] = "no flight record: it did not answer SIGUSR1 (stuck in native code?)"
    return summarize(records, world, notes)
