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


def replica_key(rank: int) -> str:
    """Where rank ``rank`` (of generation 0's numbering) publishes its replica."""
    return f"{FT_PREFIX}/replica/{rank}"


def generation_key(generation: int) -> str:
    """Where the launcher publishes generation ``generation``'s membership (generation 0 is the start)."""
    return f"{FT_PREFIX}/generation/{generation}"


def generation_prefix(generation: int) -> str:
    """The store prefix of every process group of ``generation``: a fresh one, so no key of an earlier
    generation (its addresses, its group counters, which torch restarts from 0) is read again."""
    return f"{FT_PREFIX}/groups/{generation}/"


class ReplicaFencer:
    """The launcher's part: on a rank's death, fence its replica and publish the survivors."""

    def __init__(self, store, nproc: int) -> None:
        self.store, self.nproc = store, nproc
        self.generation = 0
        self.alive = set(range(nproc))
        self.fenced: set[int] = set()
        self.events: list[dict] = []

    def replica_of(self, rank: int) -> int | None:
        key = replica_key(rank)
        return int(self.store.get(key)) if self.store.check([key]) else None

    def lost(self, rank: int, procs) -> set[int] | None:
        """``rank`` died: the ranks no longer running (it and its fenced replica), or None when the run cannot
        go on (a rank whose replica is not known yet, or no other replica left)."""
        if rank in self.fenced:
            return {rank}
        replica = self.replica_of(rank)
        if replica is None:
            return None
        replicas = {r: self.replica_of(r) for r in self.alive}
        mates = {r for r, rep in replicas.items() if rep == replica}
        survivors = self.alive - mates - {rank}
        if not survivors or any(replicas[r] is None for r in survivors):
            return None
        started = time.monotonic()
        for r in mates - {rank}:
            if procs[r].exitcode is None:
                os.kill(procs[r].pid, signal.SIGKILL)
        for r in mates | {rank}:
            procs[r].join()
        self.fenced |= mates - {rank}
        self.alive = survivors
        self.generation += 1
        event = {"ranks": sorted(survivors), "replicas": {str(r): replicas[r] for r in sorted(survivors)},
                 "lost": sorted(mates | {rank}), "lost_replica": replica, "died": rank,
                 "fence_s": time.monotonic() - started}
        self.store.set(generation_key(self.generation), json.dumps(event))
        self.events.append(event)
        return mates | {rank}
