"""Standalone ranks on this host: started, watched, stopped and reported by :func:`run_local_ranks`.

Start-up: ranks fork from a *forkserver*, a clean process that imported torch once. Forking the
launcher itself is undefined once it has threads (OpenMP pools, gloo, a checkpoint writer, a
caller's thread pool): ranks crashed in the garbage collector or hung on a lock held by a thread
that did not exist in the child. The forkserver has none, and its children skip re-importing torch,
which makes it cheaper than spawn (measured in the README). It is CUDA-safe as well.

Rendezvous: the launcher hosts the ranks' TCPStore on a socket bound to the master address only.
Each rank marks its arrival and its join in the store; a rank that has not joined within
``join_timeout_s`` ends the run with one line naming it, whatever held it up.

Several launchers (``pretrain train --nnodes N --node-rank K --rdzv-endpoint HOST:PORT``, one per node):
node 0's launcher hosts the store at the endpoint the job names, the others connect to it (``--external-store``:
every node connects to a store no node hosts, ``pretrain store``); each starts
and watches its own ``nproc`` ranks (global ranks ``K * nproc ..``). Node 0 keeps the store up until
every other node's launcher says its ranks are done (:mod:`.node_group`).

Fault tolerance (``[train].fault_tolerance = "replica"``): a rank's death ends its data-parallel replica only;
the launcher fences the replica's other ranks (on other nodes: their launchers, at its request, :mod:`.node_fences`),
publishes the survivors in its store (a node lost whole: the coordinator, :mod:`.node_group`) and, with
``respawn``, each launcher starts its lost ranks again as replacements (:mod:`.replica_membership`).

Signals: the first SIGTERM, SIGINT or SIGHUP reaching the launcher (alone, or with its whole process
group, as SLURM and Kubernetes send it, and a closed terminal or a dropped ssh session sends SIGHUP)
is forwarded to every rank once, as SIGTERM; the ranks save at
the next step boundary and exit. Ranks that have not finished ``preempt_timeout_s`` later are
killed; a second Ctrl-C (SIGINT) kills them at once, a repeated SIGTERM or SIGHUP changes nothing. A
handler of the caller's own (a test runner's) hears the signal once the ranks have stopped. Ranks ignore SIGINT and hold SIGTERM and SIGHUP pending until the
entry installs its handler (``pretrain.runtime.preempt``), so a signal during start-up is not lost.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

import torch.distributed as dist

from ..errors import UsageError
from .node_group import Heartbeats, NodeGroup
from .rank_env import LAUNCHER_ENV, STOP_SIGNALS, Aborted, RankFailed, join_key, off_a_closed_terminal

MASTER_ADDR = "127.0.0.1"
FAILURE_GRACE_S = 1.0  # after a rank fails, how long to wait for a peer whose failure is the cause
EXIT_GRACE_S = 10.0  # after every rank returned, how long it may take to exit before it is killed
# What a healthy rank reports when a peer died under it: not the error to show the user.
_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe")


def _exit_with_launcher(conn) -> None:
    conn.poll(None)  # the launcher never writes: this returns when its end closes (it died)
    os._exit(1)


def _name_process(rank: str) -> None:
    """``ps -o pid,comm``, ``top`` and ``pgrep`` show which process is which rank: ``pretrain-rank3``
    (Linux's process name, 15 characters at most). A forked rank's /proc/PID/environ keeps the
    forkserver's environment, so RANK is in ``os.environ`` but not there."""
    name = f"pretrain-rank{rank}" if len(rank) <= 2 else f"pretrain-r{rank}"
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:  # not Linux: the name stays python's
        pass


def _rank_main(env: dict[str, str], entry: Callable, args: tuple, conn) -> None:
    """Runs in each rank process: the torchrun environment, then ``entry(*args)``; reports the outcome."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher turns Ctrl-C into one SIGTERM
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP})  # pending until the entry handles them
    os.environ.clear()  # the launcher's environment now, not the forkserver's from when it started
    os.environ.update(env)
    _name_process(env["RANK"])
    threading.Thread(target=_exit_with_launcher, args=(conn,), daemon=True).start()
    try:
        reply = ("ok", entry(*args))
    except BaseException as e:  # noqa: BLE001 -- everything a rank raises is reported to the launcher
        usage = isinstance(e, UsageError)  # its subclasses too: the launcher reads "UsageError: <message>"
        reply = ("err", f"{'UsageError' if usage else type(e).__name__}: {e}", traceback.format_exc(), usage)
    try:
        conn.send(reply)
    except Exception as e:  # noqa: BLE001 -- a result that does not pickle
        conn.send(("err", f"its result could not be sent: {type(e).__name__}: {e}", traceback.format_exc(), False))


def _listening_socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


class _Failure:
    def __init__(self, rank: int, error: str, exitcode: int | None, tb: str = "", usage: bool = False) -> None:
        self.rank, self.error, self.exitcode, self.traceback, self.usage = rank, error, exitcode, tb, usage

    @property
    def collateral(self) -> bool:
        return any(c in self.error for c in _COLLATERAL)


def _running(pid: int | None) -> bool:
    """Whether process ``pid`` still runs (a zombie does not: it can write nothing more). A rank is the
    forkserver's child, not the launcher's, so its exit is read from /proc rather than waited for."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _death_message(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"exited with code {exitcode} (signal {signal.Signals(-exitcode).name})"
    return f"exited with code {exitcode} before reporting a result"


class LocalRanks:
    """``nproc`` rank processes of one run; :meth:`wait` returns their results or raises."""

    def __init__(self, nproc: int, join_timeout_s: float, preempt_timeout_s: float, log_dir: str | None = None,
                 fault_tolerance: bool = False, respawn: bool = False, nodes: NodeGroup | None = None) -> None:
        self.nproc, self.join_timeout_s, self.preempt_timeout_s = nproc, join_timeout_s, preempt_timeout_s
        self.nodes = nodes or NodeGroup()
        self.first, self.world = self.nodes.node_rank * nproc, self.nodes.nnodes * nproc  # this node's ranks: first..
        self.fault_tolerance = fault_tolerance  # a dead rank's replica is fenced and the others go on (replica_membership)
        self.fencer = None
        self.heartbeats = Heartbeats(self.nodes)
        self.respawn = respawn  # a fenced replica's ranks start again and rejoin at a step boundary
        self.log_dir = log_dir  # where the ranks write flight records (pretrain.runtime.hang); None: no hang summary
        self.stop_signal: int | None = None
        self.stop_at = self.started = 0.0
        self.procs: list = []
        self.conns: list = []
        self.store = None
        self.returned = False

    def start(self, entry: Callable, args: tuple) -> None:
        if self.nodes.nnodes > 1:
            host, port = self.nodes.host, self.nodes.port
            self.store = self.nodes.store(self.join_timeout_s)
        else:
            host, sock = MASTER_ADDR, _listening_socket(MASTER_ADDR)
            port = sock.getsockname()[1]
            self.store = dist.TCPStore(MASTER_ADDR, port, None, True, timedelta(seconds=self.join_timeout_s),
                                       wait_for_workers=False, master_listen_fd=sock.detach())
        if self.fault_tolerance:
            from .replica_membership import ReplicaFencer

            self.fencer = ReplicaFencer(self.store, self.world, self.respawn, self.nproc, self.nodes.node_rank,
                                        self.nodes.node_timeout_s)
            if self.nodes.nnodes > 1:
                self.heartbeats.start(self.join_timeout_s, self._fence_self)
        ctx = mp.get_context("forkserver")
        # imported once in the forkserver, not in every rank (the main module too: ranks would re-import
        # it). No effect when the forkserver already runs (par_groups' harness preloads torch too).
        # The trainer (and DCP, which it imports) too, whatever the entry: every rank of a run imports it.
        ctx.set_forkserver_preload(["__main__", "torch", "torch.distributed", __name__, "pretrain.training.run",
                                    entry.__module__])
        base = dict(os.environ) | {"WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.nproc), "MASTER_ADDR": host,
                "MASTER_PORT": str(port), LAUNCHER_ENV: str(os.getpid())}
        if self.fault_tolerance and self.nodes.external:  # a loss of dead ranks only: no launcher of theirs may be left
            from .replica_membership import CLAIM_ENV, CLAIM_DEAD

            base[CLAIM_ENV] = CLAIM_DEAD
        self._spawn = lambda rank, extra=None: self._start_rank(ctx, base | (extra or {}), rank, entry, args)
        for rank in range(self.nproc):
            self._spawn(rank)
        self.started = time.monotonic()  # the join timeout counts from here (not the forkserver's start)
        self.wall_started = time.time()  # flight records older than this are another run's

    def _start_rank(self, ctx, base: dict, rank: int, entry: Callable, args: tuple) -> None:
        parent, child = ctx.Pipe()
        env = base | {"RANK": str(self.first + rank), "LOCAL_RANK": str(rank), "GROUP_RANK": str(self.nodes.node_rank)}
        proc = ctx.Process(target=_rank_main, args=(env, entry, args, child), name=f"pretrain-rank{rank}")
        proc.start()
        child.close()
        if rank < len(self.procs):  # a replacement (fault tolerance)
            self.procs[rank], self.conns[rank] = proc, parent
        else:
            self.procs.append(proc)
            self.conns.append(parent)
        if self.stop_signal is not None:  # a signal came while ranks were starting
            os.kill(proc.pid, signal.SIGTERM)

    def _replace(self, gone: set[int], pending: dict, respawn: bool = True) -> None:
        """Start a replacement for each rank of a fenced replica; it rejoins at a step boundary."""
        from .replica_membership import JOIN_ENV

        for r in sorted(gone):
            pending.pop(r, None)
        if not (self.respawn and respawn) or self.stop_signal is not None or self.fencer.condemned(gone):
            return  # (a condemned replica's device computes wrong: not started again on it)
        for r in sorted(gone):
            self._spawn(r - self.first, {JOIN_ENV: str(self.fencer.generation)})
            self.fencer.joining.add(r)
            pending[r] = self.conns[r - self.first]

    def _fenced_elsewhere(self, pending: dict) -> None:
        """Fence this node's ranks of replicas another launcher lost (its requests in the store), and replace them."""
        if self.nodes.nnodes > 1:
            self.fencer.nodes.serve(self._local())
        while self.fencer.nodes.taken:
            ranks, respawn = self.fencer.nodes.taken.pop(0)
            self._replace(ranks, pending, respawn)

    def _local(self) -> dict:
        return {self.first + i: p for i, p in enumerate(self.procs)}

    def _end_waiting(self, pending: dict) -> None:
        """Every member has returned: replacements still waiting to be admitted never will; stop them. (Members
        of other nodes count too: their launchers mark them in the store.)"""
        waiting = self.fencer.waiting()
        if pending and set(pending) <= waiting and self.fencer.over():
            for r in pending:
                self.procs[r - self.first].kill()
                self.procs[r - self.first].join()
            pending.clear()

    def _fence_self(self, line: str) -> None:
        """This node is cut off from the job's store (its heartbeat's lease ran out: :mod:`.node_group`): SIGKILL
        every rank, wait until none runs, and exit 1 with ``line``, from the lease's thread, whatever the loop is
        blocked in (a call to the unreachable store)."""
        procs = list(self.procs)
        for proc in procs:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):  # gone already / not started
                pass
        deadline = time.monotonic() + EXIT_GRACE_S
        while any(_running(p.pid) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        running = [self.first + i for i, p in enumerate(procs) if _running(p.pid)]
        still = f" (ranks {', '.join(map(str, running))} still running after SIGKILL)" if running else ""
        os.write(2, f"error: {line}{still}\n".encode())
        os._exit(1)

    def _started(self, node: int) -> bool:
        """Whether every rank of ``node`` joined the run (a node lost before its first beat is timed from then)."""
        return self.store.check([join_key("joined", r) for r in range(node * self.nproc, (node + 1) * self.nproc)])

    def _lost_nodes(self) -> set[int]:
        """On node 0 at the end: the nodes taken as lost (their heartbeat stopped), now or before: none will say it
        finished."""
        self.heartbeats.silent(self.store, self._started)
        return self.heartbeats.lost

    def _watch_nodes(self, pending: dict | None = None) -> None:
        """On the coordinator (node 0; with the store apart, the lowest node not lost): a node whose heartbeat
        stopped is lost whole: the others go on without its replicas (their ranks on other nodes fenced)."""
        for k in self.heartbeats.to_publish(self.store, self._started):
            gone = self.fencer.node_lost(k, set(range(k * self.nproc, (k + 1) * self.nproc)), self._local())
            self._fenced_elsewhere({} if pending is None else pending)
            if gone is None:
                raise Aborted(f"node {k} lost: its launcher has not beaten in the store for "
                              f"{self.nodes.node_timeout_s:g} s ([train].node_timeout_s), and no replica is left", 1)
            self.nodes.done(self.store, k)  # the end of the run does not wait for it (nor where its loss was
            # published already, by the survivors' claim: no rank of it left in the membership)

    # ---- signals ---------------------------------------------------------------------------
    def on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGHUP:
            off_a_closed_terminal()
        if self.stop_signal is not None:  # SIGTERM may come twice (the group's and a wrapper's): one request
            if signum == signal.SIGINT:
                raise Aborted("interrupted again (SIGINT): stopped the ranks without saving", 130)
            return
        self.stop_signal, self.stop_at = signum, time.monotonic()
        for proc in self.procs:
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGTERM)

    def _check_stop_deadline(self) -> None:
        if self.stop_signal is not None and time.monotonic() - self.stop_at > self.preempt_timeout_s:
            name = signal.Signals(self.stop_signal).name
            raise Aborted(f"{name}: the ranks did not save and exit within [train].preempt_timeout_s="
                          f"{self.preempt_timeout_s:g} s; stopped them", 1)

    # ---- rendezvous ------------------------------------------------------------------------
    def _check_joined(self, joined: set[int]) -> None:
        """Add the ranks that have joined since; RankFailed naming the first missing one once the timeout passed."""
        for rank in range(self.world):
            if rank not in joined and self.store.check([join_key("joined", rank)]):
                joined.add(rank)
        if len(joined) == self.world or time.monotonic() - self.started <= self.join_timeout_s:
            return
        late = [r for r in range(self.world) if r not in joined]
        absent = [r for r in late if not self.store.check([join_key("arrived", r)])]
        culprits = absent or late  # the ranks that never arrived hold up the others
        what = "reach" if absent else "complete"
        others = f" (nor did ranks {', '.join(map(str, culprits[1:]))})" if len(culprits) > 1 else ""
        raise RankFailed(culprits[0], f"did not {what} the rendezvous within {self.join_timeout_s:g} s "
                                      f"([train].join_timeout_s){others}")

    def _hang_named(self, root: _Failure) -> RankFailed | None:
        """After a timeout: the error naming the rank that has not arrived, from the flight records."""
        from .hang import hang_summary, is_timeout

        if self.log_dir is None or not is_timeout(root.error):
            return None
        hang = hang_summary(self.log_dir, [p.pid for p in self.procs], self.wall_started)
        if hang is None or hang.rank is None:
            return None
        return RankFailed(hang.rank, f"hang after [train].collective_timeout_s: {hang.line}",
                          root.exitcode, root.traceback)

    # ---- waiting ---------------------------------------------------------------------------
    def wait(self) -> list[Any]:
        results: dict[int, Any] = {}
        failures: list[_Failure] = []
        joined: set[int] = set()
        pending = {self.first + i: conn for i, conn in enumerate(self.conns)}
        first_failure = None
        while pending:
            for conn in wait(list(pending.values()), timeout=0.2):
                if conn not in self.conns:  # a rank fenced in this same wait, started again
                    continue
                rank = self.first + self.conns.index(conn)
                if rank not in pending:  # a fenced rank of a replica lost in this same wait
                    continue
                del pending[rank]
                try:
                    status, *body = conn.recv()
                except (EOFError, OSError):
                    gone = self.fencer.lost(rank, self._local()) if self.fencer is not None else None
                    if gone is not None:  # its replica fenced, the others regroup without it
                        self._replace(gone, pending)
                        self._fenced_elsewhere(pending)
                        continue
                    self.procs[rank - self.first].join(timeout=1.0)
                    exitcode = self.procs[rank - self.first].exitcode
                    failures.append(_Failure(rank, _death_message(exitcode), exitcode))
                    continue
                if status == "ok":
                    results[rank] = body[0]
                    if self.fencer is not None:
                        self.fencer.returned(rank)
                else:
                    failures.append(_Failure(rank, body[0], 1, body[1], body[2]))
            if failures:
                first_failure = first_failure or time.monotonic()
                waited = time.monotonic() - first_failure > FAILURE_GRACE_S
                if not pending or waited:
                    root = next((f for f in failures if not f.collateral), None)
                    if root is None and self.nodes.nnodes > 1:  # the cause is on another node: its line, not ours
                        if other := self.nodes.other_failure(self.store):
                            raise Aborted(other, 1)
                        if not waited:
                            continue
                    root = root or failures[0]
                    raise self._hang_named(root) or RankFailed(root.rank, root.error, root.exitcode, root.traceback,
                                                               root.usage)
                continue
            if self.fencer is not None:
                self._fenced_elsewhere(pending)
                self._end_waiting(pending)
                if self.nodes.nnodes > 1:
                    self._watch_nodes(pending)
            if self.nodes.nnodes > 1 and (other := self.nodes.other_failure(self.store)):
                raise Aborted(other, 1)
            self._check_joined(joined)
            self._check_stop_deadline()
        self.returned = True
        return [results.get(self.first + i) for i in range(self.nproc)]  # None: a rank of a lost replica

    def close(self) -> None:
        """Let ranks that returned exit; kill the rest (after a failure, a timeout or a second signal)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()) if self.returned else 0)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.heartbeats.stop()
        if self.store is not None and self.nodes.nnodes > 1:
            self.nodes.finish(self.store, self.join_timeout_s if self.returned else EXIT_GRACE_S,
                              self._lost_nodes if self.fencer is not None else None)
        self.store = None


def run_local_ranks(entry: Callable, args: tuple, nproc: int, join_timeout_s: float, preempt_timeout_s: float,
                    log_dir: str | None = None, fault_tolerance: bool = False, respawn: bool = False,
                    nodes: NodeGroup | None = None) -> list[Any]:
    """Run ``entry(*args)`` on ``nproc`` local ranks; their return values in rank order (see the module doc).
    ``log_dir``: where the ranks keep flight records; a timeout then names the rank that has not arrived.
    ``fault_tolerance``: a rank's death fences its data-parallel replica and the others go on (see
    :mod:`.replica_membership`); ``respawn``: its ranks start again and rejoin. ``nodes``: this launcher is one
    of several sharing one store (:mod:`.node_group`); its ranks are its node's, the return values too."""
    ranks = LocalRanks(nproc, join_timeout_s, preempt_timeout_s, log_dir, fault_tolerance, respawn, nodes)
    handled = STOP_SIGNALS if threading.current_thread() is threading.main_thread() else ()
    previous = {s: signal.signal(s, ranks.on_signal) for s in handled}  # before start: no signal falls between
    try:
        ranks.start(entry, args)
        return ranks.wait()
    except (RankFailed, Aborted) as e:
        if ranks.store is not None and ranks.nodes.nnodes > 1:
            ranks.nodes.fail(ranks.store, f"rank {e.rank} failed: {e.error}" if isinstance(e, RankFailed) else str(e))
        raise
    finally:
        ranks.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        _pass_on(ranks.stop_signal, previous.get(ranks.stop_signal))


def _pass_on(signum: int | None, handler) -> None:
    """Once the ranks have stopped, hand the signal to the handler the caller had installed, if it is
    its own (a test runner's or an embedding program's: ``pytest`` ends its run on SIGTERM): the
    launcher must not keep it. The defaults (terminate, KeyboardInterrupt) are not called: a
    pre-empted ``pretrain train`` has saved and ends normally."""
    if signum is not None and callable(handler) and handler is not signal.default_int_handler:
        handler(signum, None)
