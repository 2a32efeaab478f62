"""A member's heartbeat in the job's store where the survivors claim a loss themselves
(:data:`~.replica_membership.CLAIM_ENV`: torchrun, or a node lost whole): each member rank adds to a counter of its
own from a thread (:class:`MemberBeat`), and a survivor claiming a loss waits for every member whose counter still
moves (:class:`Silence`): a survivor late to notice the loss (slow to leave its groups, or a collective of its own
still running) keeps beating, so it is waited for and stays a member, where a fixed settling time would pass it over
as lost. A dead member's counter stops at once."""

from __future__ import annotations

import threading
import time
from typing import Callable

BEAT_PREFIX = "pretrain/ft/beat/"
BEAT_S = 1.0  # a member's heartbeat period


def beat_key(rank: int) -> str:
    """Rank ``rank``'s (generation 0's numbering) counter: a replacement, once admitted, beats under it again."""
    return f"{BEAT_PREFIX}{rank}"


class MemberBeat:
    """This rank's beat, every :data:`BEAT_S` from a daemon thread over a connection of its own (``connect()``: a
    store client), whatever the rank computes; it ends with the process or :meth:`stop`."""

    def __init__(self, connect: Callable[[], object], rank: int) -> None:
        self.stopped = threading.Event()
        store = connect()
        store.add(beat_key(rank), 1)
        threading.Thread(target=self._beating, args=(store, rank), name="pretrain-member-beat", daemon=True).start()

    def _beating(self, store, rank: int) -> None:
        while not self.stopped.wait(BEAT_S):
            try:
                store.add(beat_key(rank), 1)
            except (RuntimeError, OSError):  # the store unreachable: this rank's collectives fail too
                return

    def stop(self) -> None:
        self.stopped.set()


class Silence:
    """A survivor's watch over some members' counters, timed on its own clock from when it first read each."""

    def __init__(self, store, quiet_s: float) -> None:
        self.store, self.quiet_s = store, quiet_s
        self.moved: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it was last seen to move)

    def silent(self, ranks) -> set[int]:
        """Those of ``ranks`` whose counter has not moved for ``quiet_s`` (dead, or never beating)."""
        now, quiet = time.monotonic(), set()
        for r in ranks:
            count = self.store.add(beat_key(r), 0)
            last = self.moved.get(r)
            if last is None or last[0] != count:
                self.moved[r] = (count, now)
            elif now - last[1] > self.quiet_s:
                quiet.add(r)
        return quiet
