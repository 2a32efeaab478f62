"""`pretrain cluster FILE [CONFIG]`: does a launch file's nodes x GPUs fit the config, before the job waits in the queue?

The file's world (nodes x GPUs per node) must fit the layout as `pretrain train` checks it, every tensor-parallel
group must stay inside one node (its collectives run at every layer), and the time between the scheduler's
SIGTERM and its kill must cover ``[train].preempt_timeout_s`` (the ranks' save) plus the agents' exit.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from ..errors import UsageError, fail

EXIT_MARGIN_S = 60  # after the ranks' save: torchrun's agents exit, and the job requeues itself


def cluster(
    file: str = typer.Argument(..., help="Launch file: an sbatch script, a Kubernetes JobSet or a SkyPilot task (tools/cluster/)."),
    config: Optional[str] = typer.Argument(None, help="TOML config or shipped name (default: the embedded tiny.toml)."),
    overrides: List[str] = typer.Option([], "--set", help="Override a key: --set parallel.tp=8 (repeatable)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Nodes, where the submission overrides the file's (sbatch --nodes=N)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs (ranks) per node, where the submission overrides the file's."),
) -> None:
    """Check a cluster launch file against the config: world size, tp within a node, pre-emption grace."""
    try:
        typer.echo(check_launch_file(file, config, overrides, nodes, gpus_per_node))
    except UsageError as e:
        raise fail(str(e))


def check_launch_file(file: str, config: str | None, overrides: list[str], nodes: int | None,
                      gpus_per_node: int | None) -> str:
    """The one line saying the file fits; a UsageError naming what does not."""
    from ..config import load_config
    from ..config.launch_files import read_launch_file

    for name, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value is not None and value < 1:
            raise UsageError(f"{name} {value} must be >= 1")
    launch = read_launch_file(file)
    nodes = nodes or launch.nodes
    gpus = gpus_per_node or launch.gpus_per_node
    for name, value in (("--nodes", nodes), ("--gpus-per-node", gpus)):
        if value is None:
            raise UsageError(f"{file} does not say its {name[2:]}; pass {name} N")
    cfg = load_config(config, overrides)
    world = nodes * gpus
    where = f"{file}: {nodes} node{'s' * (nodes > 1)} x {gpus} GPU{'s' * (gpus > 1)} = {world} ranks"
    try:
        layout = cfg.validate_world(world)
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None
    p = cfg.parallel
    if gpus % p.tp:
        raise UsageError(f"{where}: [parallel].tp={p.tp} does not fit within a node of {gpus} GPUs (tp must divide the "
                         f"GPUs per node: its collectives run at every layer); use tp in "
                         f"{[t for t in range(1, gpus + 1) if gpus % t == 0]} or --gpus-per-node a multiple of {p.tp}")
    if p.rank_assignment != "auto":  # auto re-orders the ranks to keep tp on a node; off and strict keep the order
        for group in layout.grid.ranks("tp"):
            if len({rank // gpus for rank in group}) > 1:
                raise UsageError(f"{where}: with [parallel].order={p.order!r} the tp group of ranks {group} spans "
                                 f"nodes; put tp first in the order, or set [parallel].rank_assignment = \"auto\"")
    need = cfg.train.preempt_timeout_s + EXIT_MARGIN_S
    if launch.grace_s is not None and launch.grace_s < need:
        raise UsageError(f"{where}: {launch.grace_words} gives the ranks {launch.grace_s:g} s from SIGTERM to the kill, "
                         f"less than [train].preempt_timeout_s={cfg.train.preempt_timeout_s:g} s + {EXIT_MARGIN_S} s to "
                         f"save and exit; give at least {need:g} s")
    if launch.grace_s is None and not cfg.checkpoint.every:
        raise UsageError(f"{where}: a reclaimed spot VM gets no grace to save, and [checkpoint].every=0 saves only at "
                         f"the end: a restart would start over; set --set checkpoint.every=N")
    grace = ("spot VMs are reclaimed without a grace: a restart resumes from the last [checkpoint].every save"
             if launch.grace_s is None else
             f"{launch.grace_words}: {launch.grace_s:g} s >= [train].preempt_timeout_s + {EXIT_MARGIN_S} s")
    dims = " ".join(f"{k}={getattr(layout, k)}" for k in ("tp", "cp", "pp", "dp") if hasattr(layout, k))
    return f"fits: {where}: {dims}, each tp group within a node; {grace}"
