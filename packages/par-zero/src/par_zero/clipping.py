"""Global-norm gradient clipping over a buffer's reduced grads, each element counted once."""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed import ProcessGroup

from par_groups import comm
from par_groups.param_placement import placement_of

from .adamw import clip_coefficient
from .grad_buffer import GradBuffer


@torch.no_grad()
def clip_grad_norm_(buffer: GradBuffer, max_norm: float, norm_groups: Iterable[ProcessGroup] = (),
                    expert_norm_groups: Iterable[ProcessGroup] | None = None) -> torch.Tensor:
    """Scale all grads of ``buffer`` so their global L2 norm is at most ``max_norm``; return the norm.

    The squared norm is summed over the optimizer ranges of this rank's buckets, then over the
    ranks holding the other ranges (the sharding group, and the replicas for HSDP outer 'optim'),
    then over each of ``norm_groups`` (the model-parallel groups holding other parts of the model:
    tp, pp, ...); expert params over ``expert_norm_groups`` (default: ``norm_groups``). A param
    with model-parallel copies counts on the first copy only (its placement says which). The squared
    sum of this rank's own ranges alone, every copy counted, is left in ``buffer.local_sq`` (a device
    scalar, read by nothing here)."""
    norm_groups = tuple(norm_groups)
    expert_norm_groups = norm_groups if expert_norm_groups is None else tuple(expert_norm_groups)
    device = buffer.buckets[0].device if buffer.buckets else None
    total = torch.zeros((), dtype=torch.float32, device=device)
    local = torch.zeros((), dtype=torch.float32, device=device)
    for groups, fam in buffer.families():
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for b in fam:
            for p, _, lo, hi, _ in b.opt_segments():
                part = b.opt_grad[lo:hi].float().pow(2).sum()
                local += part
                if placement_of(p).counted():
                    sq += part
        if buffer.cfg.shard_optimizer:  # the optimizer ranges are disjoint: sum them
            comm.all_reduce(sq, groups.inner)
            if fam[0].outer_optim:
                comm.all_reduce(sq, groups.outer)
        for g in norm_groups if groups is buffer.dense_groups else expert_norm_groups:
            comm.all_reduce(sq, g)
        total += sq
    buffer.local_sq = local  # this rank's own ranges, copies too, before any reduction: where a wrong bit shows first
    norm = total.sqrt()
    coef = clip_coefficient(norm, max_norm)
    for b in buffer.buckets + buffer.buddies:  # a buddy range steps from the same clipped grads as its owner
        b.opt_grad.mul_(coef)
    return norm
