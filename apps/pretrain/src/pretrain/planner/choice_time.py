"""`plan CONFIG --world N --topology PRESET`: the data-parallel communication a step leaves exposed under two
ZeRO strategies, in the estimator's model (planner/estimate.py), for the line comparing the config's
``[parallel].zero`` with the decision's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import TopologyConfig
from ..errors import UsageError
from .estimate import GRADIENT_GROUPS, Cluster, Shape, comm_seconds, group_bandwidth


def topology_spec(topology: str) -> TopologyConfig:
    """``--topology``: a preset's name or a cluster TOML file, as a ``[topology]`` section."""
    from par_groups.topology import PRESETS

    if topology in PRESETS:
        return TopologyConfig(preset=topology)
    elif Path(topology).is_file():
        return TopologyConfig(file=topology)
    else:
        raise UsageError(f"--topology {topology!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a TOML file")


def exposed_dp_seconds(cfg, world: int, topology: str, zeros: list[str]) -> dict[str, float]:
    """``{zero: seconds}`` of exposed gradient-group communication per step on ``topology``."""
    from ..runtime.rank_assignment import described_topology, workload

    spec = topology_spec(topology)
    layout, p, t = cfg.validate_world(world), cfg.parallel, cfg.train
    topo = described_topology(dataclasses.replace(cfg, topology=spec), world)
    cluster = Cluster(spec, len(topo.node_ranks()[0]), topo.largest_domain())
    shape = Shape(world, layout.tp, layout.cp, layout.pp, layout.ep, layout.etp, p.schedule, layout.vpp,
                  p.first_stage_layers, p.last_stage_layers)
    bandwidth = group_bandwidth(shape, cluster)
    work = workload(cfg, layout)
    muon = t.optimizer_declaration.matrix_dtype  # a matrix-wise optimizer's own step (Muon's Newton-Schulz)
    return {z: sum(s for name, s in comm_seconds(shape, work, z, bandwidth, muon).items() if name in GRADIENT_GROUPS)
            for z in zeros}
