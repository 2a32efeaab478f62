"""par-groups: the rank grid, explicit process groups, the counted communication layer."""

from .comm import CommRecord, CommRecorder
from .grid import LayoutError, RankGrid
from .groups import ParallelGroups, create_groups, device_mesh

__all__ = ["CommRecord", "CommRecorder", "LayoutError", "ParallelGroups", "RankGrid", "create_groups", "device_mesh"]

# Topology (NVML detection or a description) and group placement; more in par_groups.topology.
from .topology import Placement, Topology, gather_topology, place  # noqa: E402

__all__ += ["Placement", "Topology", "gather_topology", "place"]
