"""Starting the ranks: standalone (``pretrain train --nproc N``) or under ``torchrun`` / ``srun torchrun``.

Standalone ranks (:mod:`pretrain.runtime.local_launcher`) see the same ``RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT`` environment as under torchrun, so :func:`init_distributed` is the same
call in both cases. When a rank raises, the launcher stops the others at once and :func:`launch`
raises :class:`RankFailed` carrying that rank's error; a signal stops the run as
:mod:`pretrain.runtime.local_launcher` describes.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import UsageError
from .rank_env import LAUNCHER_ENV, Aborted, RankFailed, join_key  # noqa: F401 - Aborted, RankFailed: launch() raises them

MAX_CPU_PROCS = 64  # gloo on one host: beyond this, start-up and memory make no sense


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


def launch(entry: Callable[..., Any], args: tuple = (), nproc: int = 1, device: str = "auto",
           join_timeout_s: float = 300.0, preempt_timeout_s: float = 120.0, log_dir: str | None = None,
           fault_tolerance: bool = False, respawn: bool = False, nodes=None) -> list[Any]:
    """Run ``entry(*args)`` on every rank; returns the ranks' return values in rank order.

    Under torchrun this process is one rank: ``entry`` runs here (``nproc`` is ignored). Otherwise
    ``nproc`` local ranks start (1 runs in this process). ``entry`` must be a module-level function
    (ranks import it); it calls :func:`init_distributed`. A rank that has not joined the group
    within ``join_timeout_s`` ends the run; after a SIGTERM/SIGINT/SIGHUP, ranks get ``preempt_timeout_s``
    to save and exit. ``log_dir``: where the ranks write flight records (:mod:`pretrain.runtime.hang`); a
    collective's timeout then ends the run naming the rank that has not arrived. ``fault_tolerance``: a
    rank's death ends its data-parallel replica only (see :mod:`.replica_membership`); the others go on;
    ``respawn``: its ranks start again and rejoin. ``nodes`` (a :class:`.node_group.NodeGroup`): this
    launcher is one node of several sharing node 0's store; it starts that node's ``nproc`` ranks.
    """
    if under_torchrun():
        return [entry(*args)]
    check_nproc(nproc, device)
    if nproc > 1 or nodes is not None and nodes.nnodes > 1:
        from .local_launcher import run_local_ranks

        return run_local_ranks(entry, args, nproc, join_timeout_s, preempt_timeout_s, log_dir, fault_tolerance, respawn,
                               nodes)
    env = _single_rank_env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return [entry(*args)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _single_rank_env() -> dict[str, str]:
    """One rank in this process, its own launcher; its group lives in memory (nothing listens on the port)."""
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), LAUNCHER_ENV: str(os.getpid())}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous_store(rank: int, world: int, timeout_s: float) -> dist.Store | None:
    """Where the ranks meet: memory for one rank; under pretrain's launcher its store, where this rank
    marks its arrival (the launcher names a rank that never arrives); None: env://, torchrun's store."""
    if world == 1:
        return dist.HashStore()
    if LAUNCHER_ENV not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                          timedelta(seconds=timeout_s))
    store.set(join_key("arrived", rank), "1")
    return store


def cpu_threads(environ) -> int:
    """Torch threads per CPU rank: ``OMP_NUM_THREADS`` where the user or the launcher set it (torchrun sets
    1 beside other ranks), else this process's usable cores (its affinity: a cgroup or taskset may grant
    fewer than the host has) shared by the host's local ranks."""
    if environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    from .cpus import cores

    return max(1, cores() // int(environ.get("LOCAL_WORLD_SIZE", 1)))


def init_distributed(timeout_s: float = 300.0, device: str = "auto",
                     join_timeout_s: float | None = None) -> tuple[int, int, int, torch.device]:
    """Join the default process group; returns (rank, world_size, local_rank, device).

    CUDA: binds LOCAL_RANK's GPU and uses NCCL. CPU: gloo, and this host's cores are shared among
    its local ranks (torch threads per rank = cores / local ranks). ``timeout_s`` bounds every
    collective, ``join_timeout_s`` (default: the same) the rendezvous. Outside any launcher it makes a one-rank group. Idempotent.
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
            torch.set_num_threads(cpu_threads(os.environ))
        store = _rendezvous_store(rank, world, timeout_s if join_timeout_s is None else join_timeout_s)
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))  # no store: env://
        if store is not None:
            store.set(join_key("joined", rank), "1")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return rank, world, local_rank, torch.device(f"cuda:{local_rank}") if kind == "cuda" else torch.device("cpu")


def shutdown() -> None:
    """Leave the default process group (call at the end of the entry function)."""
    if dist.is_initialized():
        dist.destroy_process_group()
