"""Gradients of parameters that TP leaves partial, and the grad-norm share of each TP rank.

Explicit functions, not hooks: call ``allreduce_tp_replicated_grads`` once per step after the
last backward (after all microbatches) and before data-parallel reduction and grad clipping,
like Megatron's ``finalize_model_grads``. Hooks would fire per microbatch and hide the cost.

Two kinds of partial gradients exist (both summed in one coalesced all-reduce):
- ``sequence_parallel=True``: parameters replicated over TP (norm weights and biases, row-parallel
  biases) applied to ``[S/tp, ...]`` shards: each rank holds its sequence shard's share.
- ``tp_replicas > 1``: KV-head weights replicated on ``tp_replicas`` ranks (fewer KV heads than TP
  ranks): each replica holds its own query heads' share; summed over the ranks sharing the head.
Without SP, replicated params see the full sequence and already have identical, complete grads.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from par_groups import comm


def mark_sequence_parallel_(module: nn.Module) -> nn.Module:
    """Tag every parameter of ``module`` (a norm running on ``[S/tp, ...]``) as sequence-parallel."""
    for p in module.parameters():
        p.sequence_parallel = True
    return module


def _params(params: nn.Module | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return list(params.parameters()) if isinstance(params, nn.Module) else list(params)


def is_tp_partial(p: nn.Parameter) -> bool:
    """Whether ``p``'s gradient on one TP rank is only a share (sequence-parallel or a KV replica)."""
    return p.requires_grad and (getattr(p, "sequence_parallel", False) or getattr(p, "tp_replicas", 1) > 1)


def sum_partial_grads_(items: list[tuple[torch.Tensor, nn.Parameter]], tp_group: ProcessGroup) -> int:
    """Sum, in place and in one all-reduce, the gradient shares ``grad`` of each ``(grad, param)``.

    ``grad`` may be ``param.grad`` or any view holding that param's gradient (e.g. a slice of a
    data-parallel bucket that lines up on every TP rank). Sequence-parallel params are summed over
    the whole group; KV-head replicas only over the ranks sharing their head.
    """
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    items = [(g, p) for g, p in items if is_tp_partial(p)]
    if tp == 1 or not items:
        return 0

    def replicas(p) -> int:
        return tp if getattr(p, "sequence_parallel", False) else p.tp_replicas

    # Each KV replica writes into the slot of its head, so the sum only mixes ranks sharing a head.
    chunks = []
    for g, p in items:
        slots = torch.zeros(tp // replicas(p), g.numel(), dtype=g.dtype, device=g.device)
        slots[rank // replicas(p)] = g.reshape(-1)
        chunks.append(slots.reshape(-1))
    flat = torch.cat(chunks)
    comm.all_reduce(flat, group=tp_group)
    offset = 0
    for g, p in items:
        slots = flat[offset : offset + (tp // replicas(p)) * g.numel()].view(-1, g.numel())
        g.copy_(slots[rank // replicas(p)].view_as(g))
        offset += slots.numel()
    return len(items)


def allreduce_tp_replicated_grads(params: nn.Module | Iterable[nn.Parameter], tp_group: ProcessGroup) -> int:
    """Sum partial grads over the TP group (one all-reduce); returns the number of params synced."""
    partial = [p for p in _params(params) if is_tp_partial(p)]
    if dist.get_world_size(tp_group) == 1:
        return 0
    for p in partial:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return sum_partial_grads_([(p.grad, p) for p in partial], tp_group)


def tp_local_grad_norm_sq(params: nn.Module | Iterable[nn.Parameter], tp_group: ProcessGroup) -> torch.Tensor:
    """This rank's share of the squared grad norm: summed over the TP group it gives the full model's.

    Sharded params (``tensor_parallel``) count fully, divided by ``tp_replicas`` when replicated;
    params replicated over TP count on TP rank 0 only. Returns an fp32 scalar (not reduced).
    """
    rank = dist.get_rank(tp_group)
    total = None  # on the grads' device
    for p in _params(params):
        if p.grad is None:
            continue
        sq = p.grad.detach().float().pow(2).sum()
        total = torch.zeros_like(sq) if total is None else total
        if getattr(p, "tensor_parallel", False):
            total += sq / getattr(p, "tp_replicas", 1)
        elif rank == 0:
            total += sq
    return torch.zeros((), dtype=torch.float32) if total is None else total
