"""`pretrain topo`: show the GPU topology (detected with NVML, or described) and place a layout on it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer

from par_groups.topology import (
    HOW_TO_DESCRIBE,
    PRESETS,
    NvmlUnavailable,
    Topology,
    TopologyError,
    Workload,
    detect,
    load_toml,
    assign_ranks,
    preset,
    render_assignment,
    render_topology,
    to_toml,
)
from par_groups.topology.cost import CP_COMM_TYPES
from par_groups.topology.model import ceil_div

from ..errors import fail
from .groups import build_grid


def _described(name: Optional[str], path: Optional[Path], nodes: Optional[int], world: Optional[int],
               multiple: int = 1) -> Topology:
    """A preset or TOML topology. Without --nodes: as many nodes as --world needs, or else the
    fewest (at least the description's own count) whose GPUs are a multiple of ``multiple``."""
    if name and path:
        raise fail("give either --topology or --topology-file, not both")
    if nodes is not None and nodes < 1:
        raise fail(f"--nodes must be >= 1, got {nodes}")
    try:
        if name:
            if nodes is None and world is not None and name in PRESETS:
                nodes = ceil_div(world, PRESETS[name]["gpus_per_node"])
            topo = preset(name, nodes)
        else:
            topo = load_toml(path, nodes)
        if nodes is None and world is None and topo.world_size % multiple and _uniform(topo):
            per_node = topo.world_size // len(topo.nodes)
            grown = next(n for n in range(len(topo.nodes), len(topo.nodes) + multiple + 1) if n * per_node % multiple == 0)
            topo = preset(name, grown) if name else load_toml(path, grown)
        elif nodes is None and world is not None and world > topo.world_size and path and _uniform(topo):
            topo = load_toml(path, ceil_div(world, topo.world_size // len(topo.nodes)))
        return topo
    except TopologyError as e:
        raise fail(str(e))


def _uniform(topo: Topology) -> bool:
    """Nodes of equal size (a preset or compact description), so --nodes can be inferred."""
    return topo.source in ("preset", "described") and len({len(r) for r in topo.node_ranks()}) == 1


def topo(
    topology: Optional[str] = typer.Option(
        None, "--topology", help=f"Describe instead of detect: a preset ({', '.join(sorted(PRESETS))})."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Node count for --topology/--topology-file "
                                        "(default: the preset's, or as many as --world needs)."),
    topology_file: Optional[Path] = typer.Option(None, "--topology-file", help="A TOML topology description."),
    world: Optional[int] = typer.Option(None, "--world", help="Total ranks (default: every GPU of the topology)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor parallel size."),
    cp: Optional[int] = typer.Option(None, "--cp", help="Context parallel size."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Pipeline parallel size."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Expert parallel size."),
    etp: Optional[int] = typer.Option(None, "--etp", help="Expert tensor parallel size (default: tp)."),
    order: str = typer.Option("tp-cp-ep-dp-pp", "--order", help="The order to compare against (fastest first)."),
    hcp: Optional[str] = typer.Option(None, "--hcp", help="Hierarchical CP sizes inner,outer (product = cp)."),
    cp_comm: str = typer.Option("p2p", "--cp-comm", help=f"CP comm type without --hcp: {', '.join(CP_COMM_TYPES)}."),
    save: Optional[Path] = typer.Option(None, "--save", help="Write the topology as TOML (to plan with it later)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Print the GPU topology; with a layout (--tp/--cp/--pp/--ep ...), where each group should go."""
    layout = any(v is not None for v in (world, tp, cp, pp, ep, etp, hcp))
    if topology or topology_file:
        multiple = math.lcm((tp or 1) * (cp or 1) * (pp or 1), (etp or tp or 1) * (ep or 1) * (pp or 1))
        topo_ = _described(topology, topology_file, nodes, world, multiple)
    else:
        if nodes is not None:
            raise fail("--nodes needs --topology or --topology-file")
        try:
            topo_ = detect()
        except NvmlUnavailable as e:
            message = f"no NVIDIA GPUs found: {e}. To plan for a cluster, {HOW_TO_DESCRIBE}."
            if layout:
                raise fail(message)
            typer.echo(json.dumps({"topology": None, "message": message}) if as_json else message)
            return
    if save is not None:
        save.write_text(to_toml(topo_))
    if not layout:
        typer.echo(json.dumps(topo_.to_dict()) if as_json else render_topology(topo_))
        return
    grid = build_grid(world or topo_.world_size, tp or 1, cp or 1, pp or 1, ep or 1, etp, order, hcp)
    try:
        result = assign_ranks(grid, topo_, Workload(cp_comm=cp_comm))
    except (TopologyError, ValueError) as e:
        raise fail(str(e))
    typer.echo(json.dumps(result.to_dict()) if as_json else render_assignment(result))
