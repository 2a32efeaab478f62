"""par-moe: routers, token dispatchers, grouped SwiGLU experts, expert parallelism."""

from .capacity import capacity_keep
from .config import MoEConfig
from .declared import DeclaredRouting, RoutedSizes
from .dispatch import AllGatherDispatcher, AllToAllDispatcher, DispatchHandle, make_dispatcher
from .experts import GroupedSwiGLU, SwiGLU, grouped_mm_available, grouped_mm_supported
from .layer import MoELayer
from .router import Router, Routing, tokens_per_expert

__all__ = [
    "AllGatherDispatcher", "AllToAllDispatcher", "DeclaredRouting", "DispatchHandle", "GroupedSwiGLU", "MoEConfig",
    "MoELayer", "RoutedSizes", "Router", "Routing", "SwiGLU", "capacity_keep", "grouped_mm_available", "grouped_mm_supported", "make_dispatcher",
    "tokens_per_expert",
]
