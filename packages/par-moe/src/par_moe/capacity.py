"""Expert capacity: which (token, expert) pairs an expert keeps when it is over capacity.

Capacity is counted over this rank's tokens, before dispatch (as Megatron-LM does), so it costs
no communication. ``"probs"`` keeps each expert's ``capacity`` highest-weight tokens,
``"position"`` its first ``capacity`` tokens in token order. Dropped pairs contribute nothing.
"""

from __future__ import annotations

import torch


def capacity_keep(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int, policy: str) -> torch.Tensor:
    """[T, k] bool: True where the pair (token t, its slot j) fits its expert's capacity."""
    tokens = indices.shape[0]
    if capacity >= tokens:
        return torch.ones_like(indices, dtype=torch.bool)
    routed = torch.zeros(tokens, num_experts, dtype=torch.bool, device=indices.device).scatter_(1, indices, True)
    if policy == "position":
        kept = routed & (routed.long().cumsum(0) <= capacity)
    elif policy == "probs":
        dense = torch.full((tokens, num_experts), float("-inf"), device=weights.device)
        dense = dense.scatter(1, indices, weights.detach().float())
        best = dense.topk(capacity, dim=0).indices  # [capacity, E]
        kept = torch.zeros_like(routed).scatter_(0, best, True) & routed
    else:
        raise ValueError(f"drop policy {policy!r}; use 'probs' or 'position'")
    return kept.gather(1, indices)
