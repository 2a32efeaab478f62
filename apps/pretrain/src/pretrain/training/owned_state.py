"""What one rank owns of its model's state, by name: what a replica's live copy sends a joiner and what a
regrouped trainer copies over."""

from __future__ import annotations

import torch


def owned_state(model) -> dict[str, list[torch.Tensor]]:
    """Every piece of state this rank owns, by name: trained tensors' fp32 masters and optimizer state
    (this rank's boxes, views of its buffers), the other parameters and buffers whole. Ranks at one
    model-parallel coordinate of any two replicas own the same names and shapes. ``model``: the rank's
    ``RankModel`` (its tensors by full name, and its DP wrapper with the masters and optimizer state)."""
    dp = model.dp
    kinds = ("master",) + tuple(dp.optimizer_state.state_kinds())
    owned = {kind: dp.owned_pieces(kind) for kind in kinds}
    out = {}
    for name, t in model.full_named_tensors().items():
        if t not in owned["master"]:
            out[f"model/{name}"] = [t]
            continue
        for kind in kinds:
            out[f"{kind}/{name}"] = [box for _, box in owned[kind][t].boxes]
    return out


def buddy_state(model) -> dict[str, list[torch.Tensor]]:
    """As :func:`owned_state`, the buddy range's pieces this rank steps for the next rank of its ZeRO-1 group
    (``[train].buddy_shards``; empty without them): the masters and optimizer state only."""
    dp = model.dp
    if getattr(dp, "buddy_optimizer", None) is None:
        return {}
    kinds = ("master",) + tuple(dp.optimizer_state.state_kinds())
    held = {kind: dp.buddy_pieces(kind) for kind in kinds}
    return {f"{kind}/{name}": [box for _, box in held[kind][t].boxes]
            for name, t in model.full_named_tensors().items() if t in held["master"] for kind in kinds}
