"""All-gather and reduce-scatter along dim 0, plain and differentiable, shared by the packages.

Tensor/sequence parallelism, the MoE dispatchers and all-gather context parallelism all need
the same pair; each is the other's dual (the backward of one is the forward of the other).
Everything goes through :mod:`par_groups.comm`, so it is counted. With a group of one rank
each is the identity and communicates nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import comm


def all_gather_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``[n, ...]`` on each of P ranks -> ``[P * n, ...]`` in rank order (no autograd)."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    out = x.new_empty((p * x.shape[0], *x.shape[1:]))
    comm.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``[P * n, ...]`` on each of P ranks -> this rank's ``[n, ...]`` chunk of the sum (no autograd)."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    if x.shape[0] % p:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by the group size {p}")
    out = x.new_empty((x.shape[0] // p, *x.shape[1:]))
    comm.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _AllGatherAlongDim0(torch.autograd.Function):
    """Forward all-gather dim 0; backward reduce-scatter dim 0 (every rank's output grad is partial)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterAlongDim0(torch.autograd.Function):
    """Forward reduce-scatter dim 0 (sum of partials); backward all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


def all_gather_along_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable: all-gather dim 0 forward, reduce-scatter (sum) of the gradient backward."""
    return _AllGatherAlongDim0.apply(x, group)


def reduce_scatter_along_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable: reduce-scatter (sum) dim 0 forward, all-gather of the gradient backward."""
    return _ReduceScatterAlongDim0.apply(x, group)
