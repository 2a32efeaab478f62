"""`pretrain train [CONFIG]`: train standalone (`--nproc N` local ranks) or as one rank under torchrun."""

from __future__ import annotations

import os
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import UsageError, fail
from ..runtime.safe_files import write_atomic

USAGE_PREFIX = "UsageError: "  # how a rank's UsageError reads in the launcher's failure record
TRACEBACK_FILE = "error.log"


def train(
    config: Optional[str] = typer.Argument(None, help="TOML config (default: the embedded tiny.toml) or a shipped name."),
    overrides: List[str] = typer.Option([], "--set", help="Override a key: --set section.key=value (repeatable)."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Local ranks to start (default [train].nproc); ignored under torchrun."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu or cuda (default [train].device)."),
    nnodes: int = typer.Option(1, "--nnodes", help="Launchers (nodes) of the run, each starting --nproc ranks; under torchrun (fault_tolerance=replica): the torchruns, one per node."),
    node_rank: int = typer.Option(0, "--node-rank", help="This launcher's (or torchrun's) node, 0..nnodes-1 (node 0 hosts the store, unless --external-store)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of node 0's store (--nnodes > 1), or of `pretrain store`'s (--external-store; torchrun with fault_tolerance=replica)."),
    external_store: bool = typer.Option(False, "--external-store", help="The store at --rdzv-endpoint runs apart (`pretrain store`): node 0 joins it as every node does."),
    force: bool = typer.Option(False, "--force", help="Start a new run in a checkpoint dir that holds another run's checkpoints."),
) -> None:
    """Train a model. Without arguments: the embedded default on generated data, on the CPU."""
    from ..config import load_config
    from ..config.fault_rules import fault_tolerance_nodes
    from ..runtime.launch import Aborted, RankFailed, check_nproc, launch, under_torchrun
    from ..runtime.node_group import NodeGroup
    from ..runtime.replica_membership import JOIN_ENV
    from ..training.preflight import check_run, checkpoint_root, run_lock
    from ..training.run import run_rank

    log_dir = None
    try:
        cfg = load_config(config, overrides)
        n = nproc if nproc is not None else cfg.train.nproc
        device = device or cfg.train.device
        nodes = NodeGroup() if under_torchrun() else NodeGroup.parse(nnodes, node_rank, rdzv_endpoint,
                                                                     cfg.train.node_timeout_s, external=external_store)
        if under_torchrun() and cfg.train.fault_tolerance == "replica":  # a worker of the whole job (torchrun_replica.py)
            from ..runtime.torchrun_replica import job_rank_env

            nodes = NodeGroup.parse(nnodes, node_rank, rdzv_endpoint, cfg.train.node_timeout_s, external=True)
            n = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            os.environ.update(job_rank_env(os.environ, nodes, cfg.train.join_timeout_s))
        if not under_torchrun():
            check_nproc(n, device)
        layout = cfg.validate_world(int(os.environ["WORLD_SIZE"]) if under_torchrun() else n * nodes.nnodes)
        if not under_torchrun():
            from ..runtime.rank_assignment import check_before_launch

            check_before_launch(cfg, layout)  # rank_assignment = "strict" refuses here, exit 2
        fault_tolerance_nodes(cfg, layout, n, nodes.nnodes, under_torchrun())  # torchrun fences no other node's ranks
        leader = os.environ.get("RANK") == "0" if under_torchrun() else nodes.node_rank == 0
        if JOIN_ENV not in os.environ:  # a restarted torchrun worker joins the run: whose checks passed, whose checkpoints
            check_run(cfg, layout, force)  # the user's mistakes: one line now, not a rank's traceback later
        with run_lock(cfg.log.dir, checkpoint_root(cfg)) if leader else nullcontext():
            log_dir = cfg.log.dir
            launch(run_rank, (config, list(overrides), device, force), nproc=n, device=device,
                   join_timeout_s=cfg.train.join_timeout_s, preempt_timeout_s=cfg.train.preempt_timeout_s,
                   log_dir=cfg.log.dir if cfg.log.flight_records else None,  # flight records: a hang's summary
                   fault_tolerance=cfg.train.fault_tolerance == "replica", respawn=cfg.train.respawn, nodes=nodes)
    except UsageError as e:
        raise fail(str(e))
    except Aborted as e:  # a second Ctrl-C, or ranks that did not stop within [train].preempt_timeout_s
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=e.exit_code)
    except RankFailed as e:
        if e.usage:  # a user's mistake found inside a rank: as on one rank
            raise fail(e.error.removeprefix(USAGE_PREFIX).strip())
        _internal_error(f"rank {e.rank} failed: {e.error}", e.traceback, log_dir)
    except Exception as e:  # one in-process rank (--nproc 1, torchrun): same short line
        from ..runtime.dead_rank import name_dead_peer

        trace = traceback.format_exc()  # gloo's and NCCL's messages, C++ frames included: to the error log only
        dead = name_dead_peer(log_dir, int(os.environ.get("RANK", 0)), str(e)) if log_dir else None  # torchrun
        _internal_error(dead or f"{type(e).__name__}: {e}".splitlines()[0], trace, log_dir)


def _internal_error(cause: str, trace: str, log_dir: str | None) -> None:
    """Exit 1 with one line; the traceback goes to ``<log.dir>/error.log`` (or stderr if unwritable)."""
    where = ""
    if trace and log_dir:
        try:
            write_atomic(Path(log_dir) / TRACEBACK_FILE, trace, fsync=False)  # a symlink there is replaced
            where = f" (traceback in {Path(log_dir) / TRACEBACK_FILE})"
        except OSError:
            typer.echo(trace, err=True)
    typer.echo(f"error: {cause}{where}", err=True)
    raise typer.Exit(code=1)
