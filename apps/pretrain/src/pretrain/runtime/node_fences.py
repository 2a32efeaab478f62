"""Fencing a replica whose ranks lie on several nodes (``--nnodes``, a model-parallel block over two 8-GPU nodes):
the launcher that sees the loss fences its own ranks of it and asks, in the job's store, every other launcher
holding ranks of it to fence theirs; it publishes the survivors' next generation only once each has said its
ranks are SIGKILLed and reaped, so no process of the lost replica is left to write once that generation exists.

A request is numbered (a counter in the store) and names the ranks to fence and the generation whose membership
the requester read; each launcher reads every request in order from its loop (and while it waits for its own
request's answers: two launchers asking each other at once wait for no one). A rank started again after a fence
is not fenced by a request read from an older membership. Where two launchers see the same replica's loss (a
rank of it died on each), the first to claim it asks; the other fences its own ranks and publishes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import time

from .node_group import DONE_PREFIX, FAILED_PREFIX
from .rank_env import Aborted

FENCE_PREFIX = "pretrain/ft/fence"
POLL_S = 0.02


def claim_key(generation: int, replica: int) -> str:
    """Where the launcher that asks the others to fence ``replica``'s ranks (lost after ``generation``) says so."""
    return f"{FENCE_PREFIX}/claim/{generation}/{replica}"


def request_key(n: int) -> str:
    return f"{FENCE_PREFIX}/request/{n}"


def fenced_key(n: int, node: int) -> str:
    """Where ``node``'s launcher says it fenced its ranks that request ``n`` names."""
    return f"{FENCE_PREFIX}/fenced/{n}/{node}"


class NodeFences:
    """One launcher's part: fence its own ranks, ask the other nodes to fence theirs, answer their requests.
    ``taken``: this node's ranks fenced for another launcher's loss, with whether to start them again, for the
    launcher to replace."""

    def __init__(self, store, per_node: int, node: int, timeout_s: float) -> None:
        self.store, self.per_node, self.node, self.timeout_s = store, per_node, node, timeout_s
        self.served = 0  # the requests read so far
        self.born: dict[int, int] = {}  # rank -> the first generation its running process can be a member of
        self.taken: list[tuple[set[int], bool]] = []

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def kill(self, ranks: set[int], procs, generation: int) -> None:
        """SIGKILL this node's ``ranks`` (``procs``: its rank processes by global rank) and reap them."""
        for r in ranks:
            if procs[r].exitcode is None:
                os.kill(procs[r].pid, signal.SIGKILL)
        for r in ranks:
            procs[r].join()
            self.born[r] = generation + 1

    def claim(self, generation: int, replica: int) -> bool:
        """Whether this launcher asks for ``replica``'s fence (False: another launcher claimed the same loss)."""
        mine = str(self.node)
        return self.store.compare_set(claim_key(generation, replica), "", mine).decode() == mine

    def request(self, generation: int, ranks: set[int], procs, replace: bool) -> None:
        """Ask the launchers of ``ranks`` (none on this node) to fence them and wait until each has (answering
        other requests meanwhile); Aborted where a node failed or has not within ``timeout_s`` (nor ended): the
        survivors cannot go on beside ranks that may still write."""
        n = self.store.add(f"{FENCE_PREFIX}/count", 1)
        self.store.set(request_key(n), json.dumps({"generation": generation, "ranks": sorted(ranks), "replace": replace}))
        waiting, deadline = {self.node_of(r) for r in ranks}, time.monotonic() + self.timeout_s
        while waiting:
            self.serve(procs)
            waiting = {k for k in waiting if not self.store.check([fenced_key(n, k)])
                       and not self.store.check([f"{DONE_PREFIX}{k}"])}
            late = sorted(k for k in waiting if self.store.check([f"{FAILED_PREFIX}{k}"]))
            if late or waiting and time.monotonic() > deadline:
                k = (late or sorted(waiting))[0]
                mine = sorted(r for r in ranks if self.node_of(r) == k)
                raise Aborted(f"node {k} did not fence ranks {', '.join(map(str, mine))} of a lost replica "
                              f"{'(it failed)' if late else f'within [train].node_timeout_s={self.timeout_s:g} s'}: "
                              f"stopped the run rather than go on beside them", 1)
            if waiting:
                time.sleep(POLL_S)

    def serve(self, procs) -> None:
        """Fence this node's ranks that the requests not read yet name, and say so for each."""
        count = self.store.add(f"{FENCE_PREFIX}/count", 0)
        while self.served < count:
            n = self.served + 1
            if not self.store.check([request_key(n)]):  # counted, not written yet: read at the next call
                return
            asked = json.loads(self.store.get(request_key(n)))
            ranks = {r for r in asked["ranks"] if r in procs and self.born.get(r, 0) <= asked["generation"]}
            self.fence_asked(ranks, procs, asked["generation"])
            if ranks:
                self.taken.append((ranks, asked["replace"]))
            self.store.set(fenced_key(n, self.node), "1")
            self.served = n

    def fence_asked(self, ranks: set[int], procs, generation: int) -> None:
        """What another launcher's request asks of this node, before it answers: its ranks killed and reaped."""
        self.kill(ranks, procs, generation)
