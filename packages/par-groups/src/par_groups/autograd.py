"""All-gather and reduce-scatter along dim 0, plain and differentiable, shared by the packages.

Tensor/sequence parallelism, the MoE dispatchers and all-gather context parallelism all need
the same pair; each is the other's dual (the backward of one is the forward of the other).
Everything goes through :mod:`par_groups.comm`, so it is counted. With a group of one rank
each is the identity and communicates nothing. :func:`conjugate_pair` builds the autograd
Functions of any such pair (forward one collective, backward its conjugate) for the other packages.
"""

from __future__ import annotations

from typing import Callable

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


Op = Callable[[torch.Tensor, ProcessGroup], torch.Tensor]


def identity(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The do-nothing side of a pair (a view, so autograd sees a new output)."""
    return x.view_as(x)


def _function(name: str, forward: Op, backward: Op) -> type[torch.autograd.Function]:
    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    doc = f"Forward ``{forward.__name__}``; backward ``{backward.__name__}``. Call as ``{name}.apply(x, group)``."
    attrs = {"forward": staticmethod(fwd), "backward": staticmethod(bwd), "__doc__": doc, "__qualname__": name}
    return type(name, (torch.autograd.Function,), attrs)


def conjugate_pair(x: Op, y: Op, names: tuple[str, str]) -> tuple[type[torch.autograd.Function], type[torch.autograd.Function]]:
    """The two autograd Functions of the conjugate collectives ``x`` and ``y`` (each ``(tensor, group) -> tensor``).

    The first runs ``x`` forward and ``y`` on the gradient, the second ``y`` forward and ``x`` on the
    gradient: all-gather / reduce-scatter, identity / all-reduce, split / all-gather, all-to-all /
    the reverse all-to-all. Each backward is the exact gradient of its forward only when ``y`` is the
    conjugate of ``x`` for how the gradients are held (partial on each rank, or the same on every rank).
    """
    return _function(names[0], x, y), _function(names[1], y, x)


AllGatherDim0, ReduceScatterDim0 = conjugate_pair(all_gather_dim0, reduce_scatter_dim0, ("AllGatherDim0", "ReduceScatterDim0"))


def all_gather_along_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable: all-gather dim 0 forward, reduce-scatter (sum) of the gradient backward."""
    return AllGatherDim0.apply(x, group)


def reduce_scatter_along_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable: reduce-scatter (sum) dim 0 forward, all-gather of the gradient backward."""
    return ReduceScatterDim0.apply(x, group)
