"""Which ranks train, generation by generation, under ``[train].fault_tolerance = "replica"``: the
launcher's side and the store keys both sides read.

A failure domain is one data-parallel replica: every rank of one dp coordinate (its whole
model-parallel block). Each rank publishes its replica under :func:`replica_key` once its groups
exist. When a rank's process dies, the launcher (which holds the store: no rank's death takes it down)
kills the other ranks of that replica (fenced: a process left of a lost replica could otherwise still
write to a checkpoint or a peer) and publishes the next generation's membership under
:func:`generation_key`. The survivors, which saw a collective fail, wait for that key and build every
process group again over the store prefix :func:`generation_prefix` (:mod:`pretrain.training.fault_replica`).
"""

from __future__ import annotations

import json
import os
import signal
import time

FT_PREFIX = "pretrain/ft"
JOIN_ENV = "PRETRAIN_FT_JOIN"  # set in a replacement rank: the generation it was started after


def replica_key(rank: int) -> str:
    """Where rank ``rank`` (of generation 0's numbering) publishes its replica."""
    return f"{FT_PREFIX}/replica/{rank}"


def coords_key(rank: int) -> str:
    """Where rank ``rank`` (generation 0's numbering) publishes its grid coordinates (a replacement takes them)."""
    return f"{FT_PREFIX}/coords/{rank}"


def generation_key(generation: int) -> str:
    """Where the launcher publishes generation ``generation``'s membership (generation 0 is the start)."""
    return f"{FT_PREFIX}/generation/{generation}"


def generation_prefix(generation: int) -> str:
    """The store prefix of every process group of ``generation``: a fresh one, so no key of an earlier
    generation (its addresses, its group counters, which torch restarts from 0) is read again."""
    return f"{FT_PREFIX}/groups/{generation}/"


def ready_key(rank: int) -> str:
    """Where a replacement for rank ``rank`` says it waits to be admitted at the next step boundary."""
    return f"{FT_PREFIX}/ready/{rank}"


def condemned_key(rank: int) -> str:
    """Where rank ``rank`` says, before it exits, that it computes wrong (its replica is never replaced)."""
    return f"{FT_PREFIX}/condemned/{rank}"


def returned_key(rank: int) -> str:
    """Where a launcher marks that rank ``rank`` returned from its entry (the run is over for it)."""
    return f"{FT_PREFIX}/returned/{rank}"


def claim(store, generation: int, event: dict) -> bool:
    """Publish ``event`` as generation ``generation``'s membership unless another claimed it first: the
    launcher (a loss) and rank 0 (an admission) may race for the same number."""
    value = json.dumps(event)
    return store.compare_set(generation_key(generation), "", value).decode() == value


def latest_generation(store, generation: int = 0) -> tuple[int, dict | None]:
    """The last generation published from ``generation`` on, and its membership (None: generation 0)."""
    while store.check([generation_key(generation + 1)]):
        generation += 1
    return generation, json.loads(store.get(generation_key(generation))) if generation else None


class ReplicaFencer:
    """The launcher's part: on a rank's death, fence its replica, publish the survivors and (``respawn``)
    name the ranks to start again as replacements."""

    def __init__(self, store, nproc: int, respawn: bool = False) -> None:
        self.store, self.nproc, self.respawn = store, nproc, respawn
        self.generation = 0
        self.fenced: set[int] = set()
        self.joining: set[int] = set()  # replacements started, not admitted yet
        self.events: list[dict] = []

    def replica_of(self, rank: int) -> int | None:
        key = replica_key(rank)
        return int(self.store.get(key)) if self.store.check([key]) else None

    def members(self) -> set[int]:
        self.generation, event = latest_generation(self.store, self.generation)
        return set(range(self.nproc)) if event is None else set(event["ranks"])

    def waiting(self) -> set[int]:
        """Replacements started and not in the latest membership."""
        return self.joining - self.members()

    def condemned(self, ranks: set[int]) -> bool:
        """Whether any of ``ranks`` left the run computing wrong (training/replica_drop.py): not replaced."""
        return any(self.store.check([condemned_key(r)]) for r in ranks)

    def returned(self, rank: int) -> None:
        self.store.set(returned_key(rank), "1")

    def over(self) -> bool:
        """Every member of the latest membership returned (whichever launcher started it): no admission follows."""
        return self.store.check([returned_key(r) for r in self.members()])

    def lost(self, rank: int, procs) -> set[int] | None:
        """``procs``: this launcher's rank processes by global rank. ``rank`` died: the ranks no longer running (it and its fenced replica), or None when the run cannot
        go on (a rank whose replica is not known yet, or no other replica left)."""
        if rank in self.fenced:
            self.fenced.discard(rank)
            return {rank}
        alive = self.members()
        if rank not in alive:  # a replacement that died before it was admitted
            return {rank} if rank in self.joining else None
        replica = self.replica_of(rank)
        if replica is None:
            return None
        replicas = {r: self.replica_of(r) for r in alive}
        mates = {r for r, rep in replicas.items() if rep == replica}
        survivors = alive - mates
        if not survivors or any(replicas[r] is None for r in survivors) or not mates <= set(procs):
            return None  # (a replica spanning launchers: another node's mates cannot be fenced from here)
        started = time.monotonic()
        for r in mates - {rank}:
            if procs[r].exitcode is None:
                os.kill(procs[r].pid, signal.SIGKILL)
        for r in mates:
            procs[r].join()
        self.fenced |= mates - {rank}
        self.joining -= mates
        event = {"ranks": sorted(survivors), "replicas": {str(r): replicas[r] for r in sorted(survivors)},
                 "lost": sorted(mates), "lost_replica": replica, "died": rank, "fence_s": time.monotonic() - started}
        generation = self.generation + 1
        while not claim(self.store, generation, event):  # an admission took that number: the next
            generation += 1
            event = self._after(generation - 1, event, mates)
        self.generation = generation
        self.events.append(event)
        return mates

    def _after(self, generation: int, event: dict, mates: set[int]) -> dict:
        """``event`` rebased on the membership published as ``generation`` (it admitted a replacement)."""
        latest = json.loads(self.store.get(generation_key(generation)))
        ranks = sorted(set(latest["ranks"]) - mates)
        return event | {"ranks": ranks, "replicas": {str(r): latest["replicas"][str(r)] for r in ranks}}
