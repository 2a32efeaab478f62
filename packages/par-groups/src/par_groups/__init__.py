"""par-groups: the rank grid, explicit process groups, the counted communication layer."""

from .comm import CommRecord, CommRecorder
from .watch import CommWatch
from .dims import ParallelDims
from .grid import LayoutError, RankGrid
from .groups import ParallelGroups, create_groups, device_mesh
from .fake_world import fake_world

__all__ = ["CommRecord", "CommRecorder", "CommWatch", "LayoutError", "ParallelDims", "ParallelGroups", "RankGrid", "create_groups", "device_mesh", "fake_world"]

# Topology (NVML detection or a description) and group placement; more in par_groups.topology.
from .topology import RankAssignment, Topology, gather_topology, assign_ranks  # noqa: E402

__all__ += ["RankAssignment", "Topology", "gather_topology", "assign_ranks"]

# all-gather / reduce-scatter along dim 0, plain and differentiable (each the other's dual).
from .autograd import all_gather_along_dim0, all_gather_dim0, reduce_scatter_along_dim0, reduce_scatter_dim0  # noqa: E402

__all__ += ["all_gather_along_dim0", "all_gather_dim0", "reduce_scatter_along_dim0", "reduce_scatter_dim0"]

# Each parameter's declared placement (its block of the full tensor, copies, grad ownership).
from .param_placement import ParamPlacement, declare_, declare_copies_, place_rows_, placement_of, sum_partial_grads_  # noqa: E402

__all__ += ["ParamPlacement", "declare_", "declare_copies_", "place_rows_", "placement_of", "sum_partial_grads_"]
