"""A torchrun worker of a fault-tolerant run (``[train].fault_tolerance = "replica"``): one torchrun per node (or
per replica group), each its own local rendezvous over its workers (``--standalone``), every worker a rank of the
whole job.

The workers meet in the job's store, which no node hosts (``pretrain store``, named by ``--rdzv-endpoint``): their
global rank is ``--node-rank`` times the workers per torchrun plus ``LOCAL_RANK``, and the default process group
and every later generation's are built there, as under pretrain's own launcher
(:mod:`pretrain.training.fault_replica`). When a worker dies, its torchrun's agent stops the others (the lost
replica, fenced) and, within ``--max-restarts``, starts them again: a restarted worker set enters as replacements
(``TORCHELASTIC_RESTART_COUNT`` > 0) and rejoins at a step boundary. No launcher publishes the loss: the survivors
claim it themselves (:data:`~.replica_membership.CLAIM_ENV`).
"""

from __future__ import annotations

import os
from datetime import timedelta

from ..errors import UsageError
from .node_group import NodeGroup
from .rank_env import LAUNCHER_ENV
from .replica_membership import CLAIM_ENV, JOIN_ENV, latest_generation


def job_rank_env(environ, nodes: NodeGroup, timeout_s: float) -> dict[str, str]:
    """The environment that makes this torchrun worker rank ``node_rank * workers + LOCAL_RANK`` of the job (the
    torchrun's own ``RANK`` and ``WORLD_SIZE`` are its local rendezvous'); UsageError where torchrun spans nodes."""
    workers, local = int(environ.get("LOCAL_WORLD_SIZE", 1)), int(environ.get("LOCAL_RANK", 0))
    if int(environ.get("WORLD_SIZE", workers)) != workers:
        raise UsageError(f"[train].fault_tolerance='replica' under torchrun runs one torchrun per node (--standalone "
                         f"or --nnodes 1), its workers one replica group; got WORLD_SIZE={environ.get('WORLD_SIZE')} "
                         f"over {workers} local workers: start one torchrun per node with --nnodes and --node-rank "
                         f"given to `pretrain train`")
    env = {"RANK": str(nodes.node_rank * workers + local), "WORLD_SIZE": str(nodes.nnodes * workers),
           "MASTER_ADDR": nodes.host, "MASTER_PORT": str(nodes.port), "GROUP_RANK": str(nodes.node_rank),
           LAUNCHER_ENV: str(os.getppid()), CLAIM_ENV: "1"}
    if int(environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:  # a restarted worker set: its replica's replacement
        import torch.distributed as dist

        store = dist.TCPStore(nodes.host, nodes.port, None, False, timedelta(seconds=timeout_s))
        env[JOIN_ENV] = str(latest_generation(store)[0])
    return env
