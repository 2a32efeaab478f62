"""Which ranks train, generation by generation, under ``[train].fault_tolerance = "replica"``: the
launcher's side and the store keys both sides read.

A failure domain is one data-parallel replica: every rank of one dp coordinate (its whole
model-parallel block). Each rank publishes its replica under :func:`replica_key` once its groups
exist. When a rank's process dies, the launcher (which holds the store: no rank's death takes it down)
kills the other ranks of that replica (fenced: a process left of a lost replica could otherwise still
write to a checkpoint or a peer; its ranks on other nodes are killed by their launchers first, :mod:`.node_fences`)
and publishes the next generation's membership under
:func:`generation_key`. Where no launcher of a lost rank survives it (a node lost whole, its launcher too) or none
exists (torchrun, whose agent stops a failed worker's peers itself), the survivors claim that generation
themselves: each checks in under :func:`alive_key` and, once every member has or a settling time has passed,
:func:`survivors_event` names the replicas whose every rank checked in (under pretrain's launchers only where every
lost rank is dead: :func:`claimable`). The survivors, which saw a collective
fail, wait for that key and build every process group again over the store prefix :func:`generation_prefix`
(:mod:`pretrain.training.fault_replica`).
"""

from __future__ import annotations

import json
import time

from .node_fences import NodeFences

FT_PREFIX = "pretrain/ft"
JOIN_ENV = "PRETRAIN_FT_JOIN"  # set in a replacement rank: the generation it was started after
CLAIM_ENV = "PRETRAIN_FT_SURVIVORS_CLAIM"  # set where the survivors claim a loss no launcher publishes
# CLAIM_ENV's value under pretrain's launchers with the store apart: the survivors claim only a loss whose every
# lost rank is dead (a node lost whole, replicas on it alone); a lost replica with a rank still running is its
# launcher's to fence, and that launcher (or the coordinator, for a node lost whole) publishes the loss after
CLAIM_DEAD = "dead"


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


def alive_key(generation: int, rank: int) -> str:
    """Where a survivor of a failed collective checks in for ``generation`` (the one after the failure)."""
    return f"{FT_PREFIX}/alive/{generation}/{rank}"


def survivors_event(store, generation: int, members: set[int]) -> dict | None:
    """The loss event the survivors claim as ``generation``: the replicas every rank of which checked in under
    :func:`alive_key` (a replica with one rank missing is lost whole: its other ranks are fenced by their launcher
    or torchrun's agent, or die with their node); None where nothing is lost (every member checked in: the error
    was not a loss) or nothing is left."""
    if not store.check([replica_key(r) for r in members]):  # a rank lost before it said its replica
        return None
    alive = {r for r in members if store.check([alive_key(generation, r)])}
    replicas = {r: int(store.get(replica_key(r))) for r in members}
    lost = {r for r in members if any(replicas[m] == replicas[r] and m not in alive for m in members)}
    if not lost or lost == members:
        return None
    survivors = sorted(members - lost)
    by_replica: dict[int, list[int]] = {}
    for r in sorted(lost):
        by_replica.setdefault(replicas[r], []).append(r)
    return {"ranks": survivors, "replicas": {str(r): replicas[r] for r in survivors}, "lost": sorted(lost),
            "lost_replica": min(by_replica), "lost_by_replica": {str(k): v for k, v in by_replica.items()},
            "died": min(lost - alive), "fence_s": 0.0}


def claimable(event: dict, dead: set[int], mode: str) -> bool:
    """Whether survivors may publish ``event`` themselves (``dead``: the members whose beat stopped; ``mode``:
    CLAIM_ENV's value): under torchrun, always (its agent stops a lost worker's peers on its node, where each replica
    lies); under pretrain's launchers, only where every lost rank is dead: a live one (a spanning replica's other
    half) may still write until its launcher fences it, and a generation without it must not exist before."""
    return mode != CLAIM_DEAD or set(event["lost"]) <= dead


def lost_by_replica(event: dict) -> dict[int, list[int]]:
    """A loss event's lost ranks by replica: several where a node or the survivors' claim lost more than one."""
    return {int(k): v for k, v in event.get("lost_by_replica", {event["lost_replica"]: event["lost"]}).items()}


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

    def __init__(self, store, nproc: int, respawn: bool = False, per_node: int | None = None, node: int = 0,
                 node_timeout_s: float = 30.0) -> None:
        self.store, self.nproc, self.respawn = store, nproc, respawn
        self.generation = 0
        self.fenced: set[int] = set()
        self.joining: set[int] = set()  # replacements started, not admitted yet
        self.events: list[dict] = []
        # a replica's ranks on other nodes: fenced by their launchers at this one's request (node_fences.py)
        self.nodes = NodeFences(store, per_node or nproc, node, node_timeout_s)

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
        """``procs``: this launcher's rank processes by global rank. ``rank`` died: this node's ranks no longer
        running (it and its fenced replica's), or None when the run cannot go on (a rank whose replica is not known
        yet, or no other replica left); Aborted where another node did not fence its ranks of the replica."""
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
        if not survivors or any(replicas[r] is None for r in survivors):
            return None
        started, generation, here = time.monotonic(), self.generation, mates & set(procs)
        self.nodes.kill(here - {rank}, procs, generation)
        self.nodes.born[rank] = generation + 1
        self.fenced |= here - {rank}
        self.joining -= mates
        elsewhere = {r for r in mates - here if not self.store.check([returned_key(r)])}
        if elsewhere:  # the replica spans nodes: the others fence their ranks of it before the survivors go on
            if not self.nodes.claim(generation, replica):
                return here  # another launcher saw this loss too: it publishes it
            self.nodes.request(generation, elsewhere, procs, self.respawn and not self.condemned(mates))
        event = {"ranks": sorted(survivors), "replicas": {str(r): replicas[r] for r in sorted(survivors)},
                 "lost": sorted(mates), "lost_replica": replica, "died": rank, "fence_s": time.monotonic() - started}
        self._publish(event, mates)
        return here

    def node_lost(self, node: int, ranks: set[int], procs=None) -> set[int] | None:
        """Node 0's launcher: ``node`` (its global ``ranks``) was lost whole, launcher and ranks (its heartbeat
        stopped). Fences the other ranks of its replicas (this node's in ``procs``, the others' by their launchers:
        put in ``self.nodes.taken``, not started again, their node's share being gone), publishes the next
        generation without any of them and returns them; an empty set when none was left (they had all returned),
        None when the run cannot go on."""
        procs = procs or {}
        alive = self.members()
        gone = {r for r in ranks & alive if not self.store.check([returned_key(r)])}
        if not gone:
            return set()
        replicas = {r: self.replica_of(r) for r in alive}
        if any(rep is None for rep in replicas.values()):
            return None
        lost = {r for r in alive if replicas[r] in {replicas[g] for g in gone}}
        survivors = alive - lost
        if not survivors:
            return None
        started, here = time.monotonic(), (lost - gone) & set(procs)
        self.nodes.kill(here, procs, self.generation)
        if here:
            self.nodes.taken.append((here, False))
        elsewhere = {r for r in lost - gone - here if self.nodes.node_of(r) != node
                     and not self.store.check([returned_key(r)])}
        if elsewhere:
            self.nodes.request(self.generation, elsewhere, procs, False)
        by_replica: dict[str, list[int]] = {}
        for r in sorted(lost):
            by_replica.setdefault(str(replicas[r]), []).append(r)
        self.joining -= lost
        self._publish({"ranks": sorted(survivors), "replicas": {str(r): replicas[r] for r in sorted(survivors)},
                       "lost": sorted(lost), "lost_replica": min(replicas[r] for r in gone),
                       "lost_by_replica": by_replica, "node": node,
                       "fence_s": time.monotonic() - started}, lost)
        return lost

    def _publish(self, event: dict, mates: set[int]) -> None:
        """Claim the next generation for ``event`` (a loss of ``mates``)."""
        generation = self.generation + 1
        while not claim(self.store, generation, event):  # an admission took that number: the next
            if not mates & set(json.loads(self.store.get(generation_key(generation)))["ranks"]):
                break  # the survivors claimed this loss themselves (CLAIM_ENV): published already
            generation += 1
            event = self._after(generation - 1, event, mates)
        self.generation = generation
        self.events.append(event)

    def _after(self, generation: int, event: dict, mates: set[int]) -> dict:
        """``event`` rebased on the membership published as ``generation`` (it admitted a replacement)."""
        latest = json.loads(self.store.get(generation_key(generation)))
        ranks = sorted(set(latest["ranks"]) - mates)
        return event | {"ranks": ranks, "replicas": {str(r): latest["replicas"][str(r)] for r in ranks}}
