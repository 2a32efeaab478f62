"""Starting the ranks: standalone (``pretrain train --nproc N``) or under ``torchrun`` / ``srun torchrun``.

Standalone runs reuse torch's elastic launcher (what ``torchrun --standalone`` does) with a local
c10d rendezvous, so each rank sees the same ``RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT`` environment as under torchrun, and :func:`init_distributed` is the same call in
both cases. When a rank raises, the launcher stops the others at once (SIGTERM) and
:func:`launch` raises :class:`RankFailed` carrying that rank's error.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import UsageError

MAX_CPU_PROCS = 64  # gloo on one host: beyond this, start-up and memory make no sense


class RankFailed(RuntimeError):
    """A rank raised or died; ``rank`` is the first failing global rank, ``error`` its message."""

    def __init__(self, rank: int, error: str, exitcode: int | None = None, traceback: str = ""):
        self.rank, self.error, self.exitcode, self.traceback = rank, error, exitcode, traceback
        super().__init__(f"rank {rank} failed: {error}")


def under_torchrun() -> bool:
    """True when this process is already one rank of a launched job (torchrun, srun + torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def device_type(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' was asked for but no CUDA GPU is visible")
    return device


def check_nproc(nproc: int, device: str = "auto") -> None:
    """UsageError unless ``nproc`` local ranks make sense: 1..64 on the CPU, 1..#GPUs on CUDA."""
    if nproc < 1:
        raise UsageError(f"--nproc {nproc} must be >= 1")
    if device_type(device) == "cuda":
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise UsageError(f"--nproc {nproc} is more than the {gpus} visible GPUs (one rank per GPU)")
    elif nproc > MAX_CPU_PROCS:
        raise UsageError(f"--nproc {nproc} is more than {MAX_CPU_PROCS}, the most CPU ranks one host may start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_rank_env() -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def launch(entry: Callable[..., Any], args: tuple = (), nproc: int = 1, device: str = "auto") -> list[Any]:
    """Run ``entry(*args)`` on every rank; returns the ranks' return values in rank order.

    Under torchrun this process is one rank: ``entry`` runs here (``nproc`` is ignored). Otherwise
    ``nproc`` local ranks start (1 runs in this process). ``entry`` must be a module-level function
    (with CUDA the ranks are spawned processes that import it); it calls :func:`init_distributed`.
    """
    if under_torchrun():
        return [entry(*args)]
    check_nproc(nproc, device)
    if nproc == 1:
        saved = {k: os.environ.get(k) for k in _single_rank_env()}
        os.environ.update(_single_rank_env())
        try:
            return [entry(*args)]
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"pretrain-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.1, start_method=_start_method(device))
    # their failure tables and "terminating process" notes repeat what RankFailed says
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing.spawn")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _ReportRootCause(entry))(*args)
    except ChildFailedError as e:
        rank, failure = _root_failure(e)
        raise RankFailed(rank, _failure_message(failure), failure.exitcode, _failure_traceback(failure)) from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return [results[r] for r in sorted(results)]


# What a healthy rank reports when a peer died under it: not the error to show the user.
_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe")


class _ReportRootCause:
    """Wraps a rank's entry: a rank that only saw a peer die waits a moment before failing, so
    the launcher records the peer's own error first (it stops everyone at the first failure)."""

    def __init__(self, entry: Callable[..., Any]) -> None:
        self.entry = entry
        functools.update_wrapper(self, entry)  # the launcher logs its name

    def __call__(self, *args):
        try:
            return self.entry(*args)
        except Exception as e:
            if any(c in str(e) for c in _COLLATERAL):
                time.sleep(3.0)
            raise


def _root_failure(error):
    """The failing rank to report: the first whose error is its own, not a peer's death seen in a
    collective (timestamps have one-second resolution, so "first" alone often picks a bystander)."""
    failures = sorted(error.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    own = [(r, f) for r, f in failures if not any(c in _failure_message(f) for c in _COLLATERAL)]
    return (own or failures)[0]


def _start_method(device: str) -> str:
    """fork on the CPU (ranks skip re-importing torch: seconds on a small machine); spawn with CUDA,
    which cannot be used in a forked child once the parent has touched it."""
    return "spawn" if device_type(device) == "cuda" else "fork"


def _failure_traceback(failure) -> str:
    message = failure.message
    return str(message.get("extraInfo", {}).get("py_callstack", "")) if isinstance(message, dict) else ""


def _failure_message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message or "").strip()
    if not message or message.startswith("To enable traceback"):
        return f"exited with code {failure.exitcode}" + (f" (signal {failure.signal_name()})" if failure.exitcode < 0 else "")
    return message


def init_distributed(timeout_s: float = 300.0, device: str = "auto") -> tuple[int, int, int, torch.device]:
    """Join the default process group (env:// rendezvous); returns (rank, world_size, local_rank, device).

    CUDA: binds LOCAL_RANK's GPU and uses NCCL. CPU: gloo, and this host's cores are shared among
    its local ranks (torch threads per rank = cores / local ranks). ``timeout_s`` bounds every
    collective. Outside any launcher it makes a one-rank group. Idempotent.
    """
    kind = device_type(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(_single_rank_env())
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if kind == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise UsageError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible")
            torch.cuda.set_device(local_rank)
        else:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return rank, world, local_rank, torch.device(f"cuda:{local_rank}") if kind == "cuda" else torch.device("cpu")


def shutdown() -> None:
    """Leave the default process group (call at the end of the entry function)."""
    if dist.is_initialized():
        dist.destroy_process_group()
