"""`pretrain groups`: show which ranks form each parallel group, without starting any process."""

from __future__ import annotations

import json
from typing import Optional

import typer

from par_groups import LayoutError, RankGrid

from ..errors import fail
from ..config.layout import MAX_WORLD


def parse_sizes(text: Optional[str], option: str) -> Optional[tuple[int, ...]]:
    """'2,2' -> (2, 2); a clear error otherwise."""
    if text is None:
        return None
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise fail(f"{option} {text!r} must be comma-separated integers, e.g. 2,2")
    return sizes


def build_grid(world, tp, cp, pp, ep, etp, order, hcp) -> RankGrid:
    try:
        return RankGrid(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order, hcp=parse_sizes(hcp, "--hcp"))
    except LayoutError as e:
        raise fail(str(e))


def render_table(grid: RankGrid, gpus_per_node: int) -> str:
    cols = ["rank", "tp", "cp", "dp", "pp", "etp", "ep", "edp"]
    lines = [
        f"world={grid.world_size} tp={grid.tp} cp={grid.cp} pp={grid.pp} dp={grid.dp} "
        f"ep={grid.ep} etp={grid.etp} edp={grid.edp} order={grid.order}"
        + (f" hcp={list(grid.hcp)}" if grid.hcp else "")
    ]
    for node_start in range(0, grid.world_size, gpus_per_node):
        lines.append(f"node {node_start // gpus_per_node}:")
        lines.append("  " + " ".join(f"{c:>4}" for c in cols))
        for rank in range(node_start, min(node_start + gpus_per_node, grid.world_size)):
            c = grid.coords(rank)
            lines.append("  " + " ".join(f"{v:>4}" for v in [rank] + [c[k] for k in cols[1:]]))
    return "\n".join(lines)


def groups(
    world: int = typer.Option(..., "--world", help="Total number of ranks."),
    tp: int = typer.Option(1, "--tp", help="Tensor parallel size."),
    cp: int = typer.Option(1, "--cp", help="Context parallel size."),
    pp: int = typer.Option(1, "--pp", help="Pipeline parallel size."),
    ep: int = typer.Option(1, "--ep", help="Expert parallel size."),
    etp: Optional[int] = typer.Option(None, "--etp", help="Expert tensor parallel size (default: tp)."),
    order: str = typer.Option("tp-cp-ep-dp-pp", "--order", help="Megatron order string, fastest first."),
    hcp: Optional[str] = typer.Option(None, "--hcp", help="Hierarchical CP sizes inner,outer (product = cp)."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="For grouping the table by node."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object of every group's rank lists."),
) -> None:
    """Print the rank lists of every dense and expert group (and hierarchical CP levels)."""
    if gpus_per_node < 1:
        raise fail(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    if not 1 <= world <= MAX_WORLD:
        raise fail(f"--world {world} must be in 1..{MAX_WORLD} (the table lists every rank)")
    grid = build_grid(world, tp, cp, pp, ep, etp, order, hcp)
    if as_json:
        typer.echo(json.dumps(grid.to_dict()))
    else:
        typer.echo(render_table(grid, gpus_per_node))
