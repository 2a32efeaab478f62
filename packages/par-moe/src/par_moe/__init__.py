"""par-moe: routers, token dispatchers, grouped SwiGLU experts, expert parallelism."""

from .balance import ReplicaPlan, plan_replicas
from .capacity import capacity_keep
from .config import MoEConfig
from .declared import DeclaredRouting, RoutedSizes
from .dispatch import AllGatherDispatcher, AllToAllDispatcher, DispatchHandle, make_dispatcher
from .experts import GroupedSwiGLU, SwiGLU, grouped_mm_available, grouped_mm_supported
from .layer import MoELayer
from .placement import ExpertPlacement, pack_experts
from .replay import RoutingTape
from .replicate import ReplicatingDispatcher
from .router import Router, Routing, tokens_per_expert

__all__ = [
    "AllGatherDispatcher", "AllToAllDispatcher", "DeclaredRouting", "DispatchHandle", "ExpertPlacement", "GroupedSwiGLU", "MoEConfig",
    "MoELayer", "ReplicaPlan", "ReplicatingDispatcher", "RoutedSizes", "Router", "RoutingTape", "Routing", "SwiGLU", "capacity_keep", "grouped_mm_available", "grouped_mm_supported", "make_dispatcher",
    "pack_experts", "plan_replicas", "tokens_per_expert",
]
