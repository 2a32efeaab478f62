"""Run a function on N ranks of a gloo process group on the CPU, with workers started once.

Starting processes that import torch is slow (seconds each), so workers are forked
from a forkserver that imported torch once (and the heavy parts of torch.distributed, and whatever
the caller's ``preload`` names: a test suite's own packages, else every worker imports them), and a
:class:`RankPool`
keeps ``world_size`` worker processes alive and reuses them. For each job the workers make a
fresh gloo process group (a prefix of one TCPStore the parent hosts), run the function, and
destroy every group, so no state leaks from one test to the next.

A raising rank fails the job with that rank's traceback; a job that does not finish within its
timeout fails naming the ranks still running, with the stack of every thread of each (faulthandler,
asked for by SIGUSR1); so does a job the caller interrupts (a test's time bound). Either way the pool is killed (ranks may be
stuck in a collective) and restarted on next use, so nothing is left behind.

The function must be defined at module level (it is sent by reference): the worker imports its
module, by name or, for test files pytest imported by path, from the file.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

DEFAULT_TIMEOUT_S = float(os.environ.get("PAR_TEST_TIMEOUT", "120"))


class RankFailure(AssertionError):
    """A rank raised, or ranks did not finish in time; the message carries the tracebacks."""


def _die_with_parent() -> None:
    """Ask Linux to kill this worker when the parent dies, so a crashed pytest leaves no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _load_function(module: str, file: str | None, qualname: str) -> Callable:
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if file is None:
                raise
            spec = importlib.util.spec_from_file_location(module, file)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod  # so pickled arguments of classes from it resolve
            spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(rank: int, world_size: int, host: str, port: int, conn: Connection, stacks: str) -> None:
    _die_with_parent()
    # SIGUSR1 writes every thread's stack to this rank's file: the parent reads it when a job hangs
    stack_file = open(stacks, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import torch
    import torch.distributed as dist

    from par_groups import comm

    torch.set_num_threads(1)
    gc.freeze()  # what the forkserver imported stays: no collection walks it again
    store = dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=60))
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        job_id, module, file, qualname, payload, timeout_s = pickle.loads(msg)
        joined = False
        try:
            fn = _load_function(module, file, qualname)
            args, kwargs = pickle.loads(payload)
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"job{job_id}", store),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            joined = True
            reply = ("ok", pickle.dumps(fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion errors, to the parent
            reply = ("err", traceback.format_exc())
        try:
            conn.send_bytes(pickle.dumps(reply))
        except Exception:
            conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        ok, fn, args, kwargs, reply = reply[0] == "ok", None, None, None, None
        # The job's objects (a model, its hooks, the groups they hold) often sit in reference
        # cycles: collect them now, or their groups' gloo threads outlive the job and pile up.
        # What survives (modules the job imported) is frozen, so the next collection skips it.
        gc.collect()
        gc.freeze()
        if joined:
            if ok:
                comm.barrier(None)  # nobody closes its connections while a peer still reads from them
            dist.destroy_process_group()


# torch.distributed.checkpoint and .tensor import sympy: seconds of CPU each time a process imports them.
TORCH_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint")


class RankPool:
    """``world_size`` long-lived worker processes that run jobs together.

    ``preload``: modules the forkserver imports once, before any worker forks. The forkserver is one
    per process and keeps the preload of whoever started it, so a session passes the same list to
    every pool (the pytest plugin's ``par_preload`` ini option does); a module that fails to import
    there is skipped.
    """

    def __init__(self, world_size: int, preload: tuple[str, ...] = ()):
        import torch.distributed as dist

        self.world_size = world_size
        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
        # forkserver: one clean process imports torch once; workers fork from it in a fraction of a
        # second. (Forking the test process itself is faster still but crashes: its OpenMP state.)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*TORCH_PRELOAD, "par_groups.testing.harness", *preload])
        self._conns: list[Connection] = []
        self._procs = []
        self._stack_dir = tempfile.mkdtemp(prefix="par-rank-stacks-")
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, "127.0.0.1", self._store.port, child, self._stack_file(rank)),
                daemon=True,
                name=f"par-rank{rank}",
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._jobs = 0

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.txt")

    def stacks(self, ranks) -> str:
        """Every thread's stack in each of ``ranks`` (still running: a hang shows where it waits)."""
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)  # faulthandler writes from the signal handler, at once
        parts = []
        for rank in ranks:
            with open(self._stack_file(rank), errors="replace") as f:
                parts.append(f"--- rank {rank} stacks ---\n{f.read().strip() or '(none written)'}")
        return "\n".join(parts)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        module = fn.__module__
        file = getattr(sys.modules.get(module), "__file__", None)
        self._jobs += 1
        msg = pickle.dumps((self._jobs, module, file, fn.__qualname__, pickle.dumps((args, kwargs)), timeout))
        for conn in self._conns:
            conn.send_bytes(msg)
        try:
            return self._collect(fn, timeout)
        except BaseException:  # interrupted (the test's time bound, Ctrl-C): the ranks' stacks, and no job left in flight
            if self._procs:
                print(f"{fn.__qualname__} interrupted on {self.world_size} ranks:\n"
                      + self.stacks(range(self.world_size)), file=sys.stderr)
                self.close()
            raise

    def _collect(self, fn: Callable, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        first_error: float | None = None
        while pending:
            # After the first error, give the others a moment to report theirs, then stop.
            limit = deadline if first_error is None else min(deadline, first_error + 3.0)
            ready = wait(list(pending.values()), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = self._conns.index(conn)
                del pending[rank]
                try:
                    status, body = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    status, body = "err", f"worker process died (exit code {code})"
                if status == "ok":
                    results[rank] = pickle.loads(body)
                else:
                    errors[rank] = body
                    first_error = first_error or time.monotonic()
        if errors or pending:
            parts = [f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())]
            if pending and not errors:
                parts.insert(0, f"ranks {sorted(pending)} did not finish within {timeout:.0f} s (hang?)")
            elif pending:
                parts.append(f"ranks {sorted(pending)} were still running (likely waiting on the failed rank)")
            if pending:
                parts.append(self.stacks(sorted(pending)))
            self.close()
            raise RankFailure(f"{fn.__qualname__} failed on {self.world_size} ranks:\n" + "\n".join(parts))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._stack_dir, ignore_errors=True)


class Harness:
    """One pool per world size, started on first use and kept for the session."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self._pools: dict[int, RankPool] = {}
        self.preload = tuple(preload)

    def run(self, world_size: int, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size, self.preload)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    __call__ = run

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
