"""Gradients of parameters that TP leaves partial, and the grad-norm share of each TP rank.

Explicit functions, not hooks: call ``allreduce_tp_replicated_grads`` once per step after the
last backward (after all microbatches) and before data-parallel reduction and grad clipping,
like Megatron's ``finalize_model_grads``. Hooks would fire per microbatch and hide the cost.

Which gradients are partial is read from each parameter's declared placement (par_groups'
``ParamPlacement``, set by the layer that made it): norms and row-parallel biases replicated over
TP but fed a sequence shard (``declare_copies_(norm, tp_group, partial_grad=sequence_parallel)``),
and KV-head weights replicated on ``tp / num_kv_heads`` ranks. Without SP, replicated params see
the full sequence and already have identical, complete grads.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from par_groups.param_placement import placement_of, sum_partial_grads_


def _params(params: nn.Module | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return list(params.parameters()) if isinstance(params, nn.Module) else list(params)


def allreduce_tp_replicated_grads(params: nn.Module | Iterable[nn.Parameter], tp_group: ProcessGroup) -> int:
    """Sum partial grads over their copies (one all-reduce); returns the number of params synced."""
    if dist.get_world_size(tp_group) == 1:
        return 0
    partial = [p for p in _params(params) if p.requires_grad and placement_of(p).needs_grad_sum()]
    for p in partial:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return sum_partial_grads_([(p.grad, placement_of(p)) for p in partial])


def tp_local_grad_norm_sq(params: nn.Module | Iterable[nn.Parameter]) -> torch.Tensor:
    """This rank's share of the squared grad norm: summed over the TP group it gives the full model's.

    Each block counts on one of its copies (the placement's first). Returns an fp32 scalar (not reduced).
    """
    params = _params(params)
    total = None  # on the grads' device
    for p in params:
        if p.grad is not None and placement_of(p).counted():
            sq = p.grad.detach().float().pow(2).sum()
            total = sq if total is None else total + sq
    if total is None:  # no grads yet (a stage before its first backward): a zero where the params live
        return torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    return total
