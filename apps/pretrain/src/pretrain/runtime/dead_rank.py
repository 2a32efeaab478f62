"""A dead rank is named under torchrun too: each rank's heartbeat, and a survivor's verdict from them.

Under pretrain's own launcher a rank's death is seen by the launcher (its pipe closes) and reported in
one line. Under torchrun each rank is alone: a peer's SIGKILL reaches a survivor as gloo's "Connection
closed by peer" (NCCL's: a collective's timeout), naming no rank. So each rank of a torchrun job keeps a
heartbeat, ``<log.dir>/flight/alive_R.json`` (its host, pid, the time and its last collective: what it was
doing), rewritten every :data:`HEARTBEAT_S`; a process that ends on its own says how in its last beat
(``ended``: exited, raised ..., or :data:`LOST` for a survivor), so only a death leaves a beat open. A rank
whose collective fails on a lost connection (:func:`is_collateral`) or a timeout names the peers that are
gone (:func:`dead_peers`): one that raised, one on this host whose process died, one whose heartbeat was
not renewed within :data:`VERDICT_WAIT_S` of the failure (another host: the log dir is shared storage).
The verdict goes to ``flight/dead.json``, which ``pretrain hang`` reads (:func:`notes_of_dir`).

While it waits, the survivor holds SIGTERM and SIGHUP (torchrun's agent stops its workers with SIGTERM as
soon as one of them failed): the process is ending, the signal only ends it before its one line is out.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .hang import FLIGHT_DIR, _state, is_timeout
from .rank_env import STOP_SIGNALS
from .safe_files import write_atomic

HEARTBEAT_S = 1.0  # how often a rank renews its heartbeat file (one small atomic write)
VERDICT_WAIT_S = 2.5 * HEARTBEAT_S  # a peer whose heartbeat is not renewed within this after a failure is dead
VERDICT_FILE = "dead.json"
# What a healthy rank reports when a peer died under it (gloo, NCCL, the socket layer)
COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe",
              "Connection refused", "NCCL communicator was aborted", "remote process exited")

EXITED = "exited"
LOST = "lost a peer"  # how a survivor ends: no culprit
_beat: "Heartbeat | None" = None
_failed_at: float | None = None  # when this rank's run raised (hold_stop_signals)


def is_collateral(error: str) -> bool:
    """Whether ``error`` is what a rank sees when a peer is gone (not the fault of this rank)."""
    return any(c in error for c in COLLATERAL)


def alive_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / FLIGHT_DIR / f"alive_{rank}.json"


def describe(entry) -> str:
    """What a rank is doing, from its watch's last entry (a ``par_groups.watch.Entry`` or its dict)."""
    if entry is None:
        return "no collective yet (starting up)"
    get = entry.get if isinstance(entry, dict) else lambda k: getattr(entry, k)
    peer = get("peer")
    call = (f"{get('op')} {'to' if get('op') == 'send' else 'from'} rank {peer} on {get('group')}" if peer is not None
            else f"{get('op')} #{get('seq')} on {get('group')}")
    return f"in {call}" if get("end") is None else f"computing after {call}"


class Heartbeat:
    """A daemon thread rewriting this rank's heartbeat file until the process ends (or :meth:`stop`)."""

    def __init__(self, log_dir: str | Path, rank: int, world: int, watch=None) -> None:
        self.log_dir, self.rank, self.world, self.watch = Path(log_dir), rank, world, watch
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self.ended: str | None = None  # how this process ended, once it does (its last beat says so)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pretrain-heartbeat", daemon=True)

    def record(self) -> dict:
        entries = getattr(self.watch, "entries", None)
        try:
            last = entries[-1] if entries else None
        except IndexError:  # emptied meanwhile
            last = None
        record = {"rank": self.rank, "world": self.world, "host": self.host, "pid": self.pid, "time": time.time(),
                  "doing": describe(last)}
        return record | ({"ended": self.ended} if self.ended is not None else {})

    def beat(self) -> None:
        with self._lock:  # the thread's beat never lands after the last one
            if self._stop.is_set() and self.ended is None:
                return
            try:
                write_atomic(alive_path(self.log_dir, self.rank), json.dumps(self.record()), fsync=False)
            except OSError:  # a full or vanished log dir must not end the run: the verdict is a best effort
                pass

    def end(self, how: str) -> None:
        """The last beat: how this process ended (a peer seeing its connection close then knows it is no death)."""
        with self._lock:
            if self.ended is not None:
                return
            self._stop.set()
            self.ended = how
        self.beat()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.beat()

    def start(self) -> "Heartbeat":
        (self.log_dir / FLIGHT_DIR).mkdir(parents=True, exist_ok=True)
        if self.rank == 0:  # an earlier attempt's verdict is not this run's (each rank's beat replaces its own)
            (self.log_dir / FLIGHT_DIR / VERDICT_FILE).unlink(missing_ok=True)
        self.beat()
        self._thread.start()
        atexit.register(self.end, EXITED)  # not run on a SIGKILL: that death keeps its heartbeat open
        return self


def start_heartbeat(log_dir: str | Path, rank: int, world: int, watch=None) -> Heartbeat:
    """This process's heartbeat (one per process; a second call replaces the watch it reads)."""
    global _beat
    if _beat is None:
        _beat = Heartbeat(log_dir, rank, world, watch).start()
    _beat.watch = watch
    return _beat


def hold_stop_signals() -> None:
    """A failing rank under a heartbeat: SIGTERM/SIGHUP stay pending (see the module doc)."""
    global _failed_at
    _failed_at = _failed_at or time.time()
    if _beat is not None and threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS) - {signal.SIGINT})


@dataclass(frozen=True)
class Dead:
    rank: int
    host: str
    pid: int
    doing: str  # at its last heartbeat
    how: str  # "its process P exited" / "its process P stopped its heartbeat at HH:MM:SS"
    last_beat: float

    def line(self, failed_at: float) -> str:
        return (f"rank {self.rank} failed on host {self.host}: {self.how} "
                f"(its last heartbeat, {max(0.0, failed_at - self.last_beat):.1f} s before: {self.doing})")


def _load(path: Path):
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    ok = isinstance(record, dict) and all(type(record.get(k)) is t for k, t in
                                          (("rank", int), ("pid", int), ("host", str), ("doing", str)))
    ok = ok and type(record.get("time")) in (int, float) and isinstance(record.get("ended", ""), str)
    return record if ok else None


def heartbeats(log_dir: str | Path) -> dict[int, dict]:
    return {r["rank"]: r for p in sorted((Path(log_dir) / FLIGHT_DIR).glob("alive_*.json")) if (r := _load(p))}


def _gone(record: dict, host: str) -> bool:
    """A peer on this host whose process has exited (or is a zombie); False where it cannot be told."""
    if record["host"] != host:
        return False
    state = _state(record["pid"])
    return state is None or state in "ZX"


def _verdict(record: dict, host: str, failed_at: float) -> tuple[int, str] | None:
    """(order, how) for a peer that is gone, None for one alive, (9, "") while it cannot be told yet."""
    pid, ended = record["pid"], record.get("ended")
    if ended == LOST:  # a survivor that has named its dead peer and ended
        return None
    if ended is not None:  # it ended on its own: an error of its own, or an exit while the others ran
        return (0 if ended != EXITED else 3), f"its process {pid} {ended}"
    if _gone(record, host):
        return 1, f"its process {pid} died without exiting (killed: SIGKILL, the OOM killer ...)"
    if record["time"] > failed_at:
        return None
    return 9, ""


def dead_peers(log_dir: str | Path, rank: int, failed_at: float, wait_s: float = VERDICT_WAIT_S,
               host: str | None = None) -> list[Dead]:
    """The peers of ``rank`` that are gone, from their heartbeats, the first culprit first: a peer that
    ended on an error of its own; one on this host whose process died (killed); one whose heartbeat
    was not renewed by ``failed_at + wait_s`` (another host's process dead or stopped); one that exited.
    Waits at most until then (no longer once every peer is told)."""
    host = host or socket.gethostname()
    deadline = failed_at + wait_s
    while True:
        peers = {r: b for r, b in heartbeats(log_dir).items() if r != rank}
        verdicts = {r: v for r, b in peers.items() if (v := _verdict(b, host, failed_at)) is not None}
        if all(v[0] != 9 for v in verdicts.values()) or time.time() >= deadline:
            break
        time.sleep(min(0.1, max(0.0, deadline - time.time())))
    stopped = {r: (2, f"its process {peers[r]['pid']} stopped its heartbeat at "
                      f"{time.strftime('%H:%M:%S', time.localtime(peers[r]['time']))}")
               for r, v in verdicts.items() if v[0] == 9}
    verdicts |= stopped
    return [Dead(r, peers[r]["host"], peers[r]["pid"], peers[r]["doing"], how, peers[r]["time"])
            for r, (_, how) in sorted(verdicts.items(), key=lambda kv: (kv[1][0], kv[0]))]


def name_dead_peer(log_dir: str | Path, rank: int, error: str, failed_at: float | None = None) -> str | None:
    """After this rank's run raised ``error`` (under torchrun, where a heartbeat runs): when it is a lost
    peer, the line naming the peer that is gone (the verdict recorded in ``flight/dead.json``); None
    otherwise (this rank's own error: its last beat says so, for its peers to name it)."""
    if _beat is None:
        return None
    cause = error.splitlines()[0] if error.strip() else "an error"
    if not (is_collateral(error) or is_timeout(error)):  # NCCL: a dead peer is a collective's timeout
        _beat.end(f"raised {cause}")
        return None
    hold_stop_signals()
    failed_at = failed_at or _failed_at or time.time()
    dead = dead_peers(log_dir, rank, failed_at)
    _beat.end(LOST)
    if not dead:
        return None
    verdict = {"seen_by": rank, "time": time.time(), "error": cause[:500],
               "dead": [{"rank": d.rank, "host": d.host, "pid": d.pid, "doing": d.doing, "how": d.how} for d in dead]}
    try:
        write_atomic(Path(log_dir) / FLIGHT_DIR / VERDICT_FILE, json.dumps(verdict, indent=1), fsync=False)
    except OSError:
        pass
    first, others = dead[0], dead[1:]
    entries = list(getattr(_beat.watch, "entries", ()))
    waiting = next((e for e in reversed(entries) if e.end is None), None)
    lost = f"; rank {rank} lost it {describe(waiting)}" if waiting is not None else ""
    more = f"; also gone: {', '.join(f'rank {d.rank} (host {d.host})' for d in others)}" if others else ""
    return f"{first.line(failed_at)}{lost}{more}"


def notes_of_dir(log_dir: str | Path) -> dict[int, str]:
    """For ``pretrain hang``: what the survivors' verdict says of each dead rank, else its last heartbeat."""
    notes = {r: f"last heartbeat from host {b['host']}, pid {b['pid']}, {b['doing']}"
             for r, b in heartbeats(log_dir).items()}
    verdict = _load_verdict(Path(log_dir) / FLIGHT_DIR / VERDICT_FILE)
    for d in verdict:
        notes[d["rank"]] = f"dead on host {d['host']}: {d['how']}, last seen {d['doing']}; seen by rank {d['seen_by']}"
    return notes


def _load_verdict(path: Path) -> list[dict]:
    try:
        verdict = json.loads(path.read_bytes().decode("utf-8"))
        dead = verdict["dead"]
        seen_by = verdict["seen_by"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return []
    keys = (("rank", int), ("pid", int), ("host", str), ("doing", str), ("how", str))
    if type(seen_by) is not int or not isinstance(dead, list):
        return []
    return [d | {"seen_by": seen_by} for d in dead
            if isinstance(d, dict) and all(type(d.get(k)) is t for k, t in keys)]
