"""Autograd-aware collectives of the MoE layer, all issued through ``par_groups.comm``.

Each says what it does forward and backward:

* ``all_to_all_tokens``: all-to-all with split sizes forward, the reverse all-to-all backward.
* ``gather_tokens``: all-gather along dim 0 forward, reduce-scatter of the gradient backward.
* ``reduce_scatter_tokens``: reduce-scatter along dim 0 forward, all-gather backward.
* ``gather_no_grad`` / ``exchange_counts``: plain collectives for indices and counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from par_groups import all_gather_along_dim0, all_gather_dim0, comm, reduce_scatter_along_dim0
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_to_all(x: torch.Tensor, group: ProcessGroup, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), group, output_splits, input_splits)
    return out


class _AllToAllTokens(torch.autograd.Function):
    """Forward: all-to-all rows with split sizes. Backward: the same all-to-all reversed."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all_tokens(x: torch.Tensor, group: ProcessGroup, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    return _AllToAllTokens.apply(x, group, output_splits, input_splits)


def gather_tokens(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return all_gather_along_dim0(x, group)


def reduce_scatter_tokens(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return reduce_scatter_along_dim0(x, group)


def gather_no_grad(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 of a tensor that carries no gradient (indices, masks)."""
    if x.dtype == torch.bool:
        return all_gather_dim0(x.to(torch.uint8), group).bool()
    return all_gather_dim0(x, group)


def exchange_counts(counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """counts [P * n] (n per destination rank) -> [P * n] received (n from each source rank)."""
    out = torch.empty_like(counts)
    comm.all_to_all_single(out, counts.contiguous(), group)
    return out
