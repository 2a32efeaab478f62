"""One launcher of several (``pretrain train --nnodes N --node-rank K --rdzv-endpoint HOST:PORT``): which node
this is, the shared store and the end of the run.

Node 0's launcher hosts the ranks' store at the endpoint the job names (every node must reach it; a SLURM job
names its first node), the others connect to it. With ``--external-store`` the store runs apart, in a process no
training node hosts (``pretrain store``), and every node, node 0 too, connects to it: then node 0's death (its
launcher with its ranks) takes the store with it no more, and the other nodes go on without its replicas. The
store lives in a launcher, not in a rank, so under
``[train].fault_tolerance = "replica"`` no rank's death takes it down. At the end each other node marks its
launcher done in the store and node 0 closes the store only once every node has (or the wait is over): a
node still fencing a replica or admitting a replacement would otherwise lose the store under it. A launcher
whose run fails says so in the store, and every other launcher stops its ranks at once with that line, rather
than after a collective's or the regroup's timeout.

Under ``[train].fault_tolerance = "replica"`` each other launcher beats in the store (a counter it adds to every
:data:`BEAT_S`, from a thread, once before its ranks start); node 0's launcher takes a node whose counter has not
moved for ``[train].node_timeout_s`` (timed from its last move, or, for one that never moved, from when that node's
ranks joined) as lost whole, launcher and ranks (:class:`Heartbeats`), and publishes the next generation without
its replicas: the survivors go on then, not at ``join_timeout_s``. Each other launcher holds that heartbeat as a
lease: one that has not renewed it for half of ``node_timeout_s`` (cut off from the store, alive) fences its own
ranks and exits (:meth:`Heartbeats.start`), so a node taken as lost can no longer write or talk. With the store apart
node 0's launcher beats and holds the lease too, and every launcher watches every other: the coordinator, the lowest
node not taken as lost (node 0 until it is), fences and publishes a lost node's replicas; with node 0's store, node 0
is the only coordinator (the store ends with it).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ..errors import UsageError

DONE_PREFIX = "pretrain/nodes/done/"
FAILED_PREFIX = "pretrain/nodes/failed/"
BEAT_PREFIX = "pretrain/nodes/beat/"
BEAT_S = 1.0  # a launcher's heartbeat period (shorter where node_timeout_s is short: eight beats to a timeout)
# A launcher whose last renewed beat is older than this share of node_timeout_s fences itself. It times the beat from
# when it was sent, never later than when the store counted it, and node 0 times the silence from no earlier than
# that count, so the fence ends this much of node_timeout_s before node 0 takes the node as lost; the other half is
# the margin for the kill and reap, the watch's poll and a loaded machine's scheduling.
LEASE_SHARE = 0.5


@dataclass(frozen=True)
class NodeGroup:
    nnodes: int = 1
    node_rank: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    node_timeout_s: float = 30.0  # a node silent for this long is lost (fault tolerance)
    external: bool = False  # the store runs apart (`pretrain store`): every node is its client

    @classmethod
    def parse(cls, nnodes: int, node_rank: int, endpoint: str | None, node_timeout_s: float = 30.0,
              external: bool = False) -> "NodeGroup":
        """The launcher's place from its flags; UsageError naming the flag that is wrong. ``external``: the store at
        the endpoint runs apart (needed then even with one node)."""
        if nnodes < 1:
            raise UsageError(f"--nnodes {nnodes} must be >= 1")
        if not 0 <= node_rank < nnodes:
            raise UsageError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
        if nnodes == 1 and not external:
            return cls()
        host, _, port = (endpoint or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            if external:
                raise UsageError(f"--rdzv-endpoint {endpoint!r} must be HOST:PORT of the job's store (`pretrain store "
                                 f"--port PORT` on a host every node reaches)")
            raise UsageError(f"--rdzv-endpoint {endpoint!r} must be HOST:PORT (the first node's address and a free "
                             f"port, the same on every node) when --nnodes {nnodes} > 1")
        return cls(nnodes, node_rank, host, int(port), node_timeout_s, external)

    def store(self, timeout_s: float) -> dist.TCPStore:
        """Node 0: the store, listening at the endpoint; the others: a client that waits for it up to ``timeout_s``."""
        if self.node_rank or self.external:
            return dist.TCPStore(self.host, self.port, None, False, timedelta(seconds=timeout_s))
        return serve_store(self.host, self.port, timeout_s, f"--rdzv-endpoint {self.host}:{self.port}: node 0")

    def finish(self, store, wait_s: float, lost: Callable[[], set[int]] | None = None) -> None:
        """The others: mark this node done; node 0: wait (up to ``wait_s``) for every other node's mark (an external
        store outlives every node: nothing to wait for), or for ``lost()`` to name it (its heartbeat stopped: it will
        never mark itself); one line on stderr naming the nodes that did neither when the wait runs out."""
        try:
            if self.node_rank or self.external:
                store.set(f"{DONE_PREFIX}{self.node_rank}", "1")
                return
            deadline = time.monotonic() + wait_s
            left = set(range(1, self.nnodes))
            while left:
                left -= {k for k in left if store.check([f"{DONE_PREFIX}{k}"])} | (lost() if lost else set())
                if left and time.monotonic() >= deadline:
                    print(f"pretrain: node 0 closes the store: node(s) {', '.join(map(str, sorted(left)))} did not say "
                          f"they finished within {wait_s:g} s", file=sys.stderr)
                    return
                time.sleep(0.1 if left else 0)
        except (RuntimeError, OSError):  # node 0 gone (it failed): nothing left to tell
            pass

    def fail(self, store, message: str) -> None:
        """Tell the other launchers this node's run failed (``message``: its one line)."""
        try:
            store.set(f"{FAILED_PREFIX}{self.node_rank}", message)
        except (RuntimeError, OSError):  # the store is gone: node 0 failed first
            pass

    def done(self, store, node: int) -> None:
        """Mark ``node`` done for it (node 0, for a node lost whole: :meth:`finish` does not wait for it)."""
        store.set(f"{DONE_PREFIX}{node}", "1")

    def other_failure(self, store) -> str | None:
        """The line of another node whose run failed, if one has."""
        for k in range(self.nnodes):
            if k != self.node_rank and store.check([f"{FAILED_PREFIX}{k}"]):
                return f"node {k} failed: {store.get(f'{FAILED_PREFIX}{k}').decode().splitlines()[0]}"
        return None


class Heartbeats:
    """A launcher's heartbeat in the store, and node 0's watch over the others'. A counter, not a time: the
    nodes' clocks need not agree; node 0 times each counter's last move on its own clock."""

    def __init__(self, nodes: NodeGroup) -> None:
        self.nodes = nodes
        self.next_beat = 0.0
        self.moved: dict[int, tuple[int, float]] = {}  # node -> (its counter, when node 0 saw it move)
        self.lost: set[int] = set()
        self.stopped = threading.Event()
        self.period = min(BEAT_S, nodes.node_timeout_s / 8)
        self.lease_s = nodes.node_timeout_s * LEASE_SHARE
        self.renewed = 0.0  # when the last beat the store counted was sent
        self.published: set[int] = set()  # the lost nodes this launcher handled as the coordinator

    @property
    def beating(self) -> bool:
        """Whether this launcher beats: every node but the store's host (node 0, unless the store runs apart)."""
        return bool(self.nodes.node_rank or self.nodes.external)

    def watched(self, store) -> list[int]:
        """The nodes whose beat this launcher times: node 0's launcher, the others'. With the store apart, the
        coordinator's, every other node's; any other launcher's, the coordinator's alone (the lowest node below it
        neither lost nor done), whose silence hands the role on: a few store calls per launcher, not one per node."""
        n = self.nodes
        if not n.external:
            return [] if n.node_rank else list(range(1, n.nnodes))
        coordinator = next((k for k in range(n.node_rank)
                            if k not in self.lost and not store.check([f"{DONE_PREFIX}{k}"])), None)
        return [k for k in range(n.nnodes) if k != n.node_rank] if coordinator is None else [coordinator]

    def start(self, timeout_s: float, fence: Callable[[str], None] | None = None) -> None:
        """Where this launcher beats (:attr:`beating`): once now (before this node's ranks start, so a node whose
        ranks run has beaten) and then every beat period from a thread over a connection of its own, whatever the launcher's loop is
        doing (starting the forkserver, fencing a replica): a busy launcher is not a lost node. ``fence(line)``:
        called from a thread of its own (the store may hold the others blocked) once no beat was renewed for
        :attr:`lease_s`; it must stop this node's ranks."""
        if not self.beating:
            return
        store = self.nodes.store(timeout_s)
        self.renewed = time.monotonic()
        self.beat(store)
        threading.Thread(target=self._beating, args=(store,), name="pretrain-heartbeat", daemon=True).start()
        if fence is not None:
            threading.Thread(target=self._leasing, args=(fence,), name="pretrain-lease", daemon=True).start()

    def _beating(self, store) -> None:
        while not self.stopped.wait(self.period):
            sent = time.monotonic()
            try:
                if not self.beat(store):
                    continue
            except (RuntimeError, OSError):  # the store unreachable: a fresh connection (the lease decides how long)
                try:
                    store = self.nodes.store(self.lease_s)
                except (RuntimeError, OSError):
                    pass
                continue
            self.renewed = sent

    def _leasing(self, fence: Callable[[str], None]) -> None:
        while not self.stopped.wait(min(0.1, self.lease_s / 10)):
            silent = time.monotonic() - self.renewed
            if silent > self.lease_s:
                n = self.nodes
                who = "node 0 takes" if n.node_rank else "the other nodes take"
                fence(f"node {n.node_rank} cut off from the job's store at {n.host}:{n.port}: its heartbeat not "
                      f"renewed for {silent:.1f} s (half of [train].node_timeout_s={n.node_timeout_s:g}); stopped "
                      f"its ranks before {who} it as lost")
                return

    def stop(self) -> None:
        self.stopped.set()

    def beat(self, store) -> bool:
        """Add to this node's counter (where it beats), once per beat period (whether it did now)."""
        now = time.monotonic()
        if self.beating and now >= self.next_beat:
            store.add(f"{BEAT_PREFIX}{self.nodes.node_rank}", 1)
            self.next_beat = now + self.period
            return True
        return False

    def silent(self, store, started: Callable[[int], bool] = lambda node: False) -> list[int]:
        """The watched nodes whose counter has not moved for ``node_timeout_s`` (each named once): since this launcher
        saw it move, or, for a counter that never moved (a node lost before its first beat), since it first saw
        ``started(node)`` (its ranks joined the run); a node still starting is not timed."""
        now, silent = time.monotonic(), []
        for k in self.watched(store):
            if k in self.lost or store.check([f"{DONE_PREFIX}{k}"]):
                continue
            count = store.add(f"{BEAT_PREFIX}{k}", 0)
            last = self.moved.get(k)
            if last is None or last[0] != count:
                if count or started(k):
                    self.moved[k] = (count, now)
            elif now - last[1] > self.nodes.node_timeout_s:
                self.lost.add(k)
                silent.append(k)
        return silent

    def coordinating(self, store) -> bool:
        """Whether this launcher acts for the job on a lost node: node 0's with its store; with the store apart, the
        lowest node neither taken as lost here nor done (node 0's silence past ``node_timeout_s`` hands the role on:
        its lease fenced it at half that)."""
        if not self.nodes.external:
            return not self.nodes.node_rank
        return all(k in self.lost or store.check([f"{DONE_PREFIX}{k}"]) for k in range(self.nodes.node_rank))

    def to_publish(self, store, started: Callable[[int], bool] = lambda node: False) -> list[int]:
        """The nodes lost (their beat silent) that this launcher, as the coordinator, has to fence and publish now:
        each once; those lost before it became the coordinator too (a loss its predecessor published already is
        found so by :meth:`.replica_membership.ReplicaFencer.node_lost`, with no rank of it left to fence)."""
        self.silent(store, started)
        if not self.coordinating(store):
            return []
        due = sorted(self.lost - self.published)
        self.published |= set(due)
        return due


def serve_store(host: str, port: int, timeout_s: float, who: str) -> dist.TCPStore:
    """A TCPStore server listening at ``host:port`` (bound there only); UsageError starting with ``who`` where it
    cannot listen."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"{who} cannot listen there ({e.strerror}); name this host's address and a free port") from None
    sock.listen(128)
    return dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())
