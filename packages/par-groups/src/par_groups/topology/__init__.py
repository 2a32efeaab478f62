"""Topology: what the hardware looks like (NVML or a description) and where groups should go.

* :class:`Topology` - GPUs in global-rank order, nodes, NVLink domains, link-class bandwidths;
  :func:`preset` / :func:`load_toml` / :func:`from_dict` describe one without GPUs.
* :func:`detect` (this host) and :func:`gather_topology` (all ranks, all-gathered) ask NVML;
  :class:`NvmlUnavailable` says why they cannot.
* :func:`place` chooses the order string and permutation; ``create_groups(p.grid,
  permutation=p.permutation)`` creates the groups it chose. :func:`evaluate` scores a given one.
"""

from .cost import Workload, bytes_per_step
from .describe import PRESETS, from_dict, load_toml, preset, preset_names, to_toml
from .model import LINK_CLASSES, Gpu, Topology, TopologyError, uniform
from .nvml import HOW_TO_DESCRIBE, NvmlUnavailable, local_view, probe_host
from .gather import detect, gather_topology, gather_views, merge_views
from .assignment import GroupCost, RankAssignment, evaluate, assign_ranks
from .report import render_assignment, render_topology

__all__ = [
    "Gpu", "GroupCost", "HOW_TO_DESCRIBE", "LINK_CLASSES", "NvmlUnavailable", "PRESETS", "RankAssignment",
    "Topology", "TopologyError", "Workload", "bytes_per_step", "detect", "evaluate", "from_dict",
    "gather_topology", "gather_views", "load_toml", "local_view", "merge_views", "assign_ranks", "preset", "preset_names",
    "probe_host", "render_assignment", "render_topology", "to_toml", "uniform",
]
