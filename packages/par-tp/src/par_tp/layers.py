"""Column- and row-parallel linear layers (Megatron's split of a matrix product over TP ranks).

Sequence-first activations ``[S, B, H]``. A column-parallel layer owns ``out/tp`` output rows of
the weight and needs the full input; a row-parallel layer owns ``in/tp`` input columns, produces
a partial sum and reduces it over the group. Column followed by row needs one reduction.

Each parameter declares its placement (par_groups' ``declare_``): weights split by rows or
columns over TP; the row-parallel bias is a copy on every TP rank whose gradient is a partial
sum over sequence shards with ``sequence_parallel`` (see ``grads.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from par_groups.param_placement import declare_

from .comm import (
    enter_tensor_parallel_region,
    exit_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from .overlap import all_gather_matmul, matmul_reduce_scatter
from .sharding import check_divisible, gather_tensor, shard_tensor


class _LoadsFullWeight:
    """``Layer.from_full(full_weight, tp_group, full_bias=None, **options)``: build and load this rank's shard."""

    @classmethod
    def from_full(cls, full_weight: torch.Tensor, tp_group: ProcessGroup, full_bias: torch.Tensor | None = None, **kw):
        out_f, in_f = full_weight.shape
        layer = cls(in_f, out_f, tp_group, bias=full_bias is not None, dtype=full_weight.dtype, device=full_weight.device, **kw)
        return layer.load_full_(full_weight, full_bias)


def _new_param(shape, dtype, device, std: float = 0.02) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std))


class _LocalMatmul:
    """The rank-local ``F.linear`` of a TP layer, replaceable per layer by another kernel with the
    same signature ``(x, weight, bias=None)`` (e.g. Transformer Engine's, for FP8): the weight
    Parameter, its sharding and the communication stay this package's."""

    linear_kernel = staticmethod(F.linear)


class ColumnParallelLinear(_LoadsFullWeight, _LocalMatmul, nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` split by output rows; output ``[..., out/tp]`` (or full with gather_output).

    Input: ``[S, B, in]`` replicated, or ``[S/tp, B, in]`` with ``sequence_parallel`` (all-gathered
    here; its gradient is reduce-scattered back).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group: ProcessGroup,
        bias: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        comm_overlap: bool = False,
    ):
        super().__init__()
        tp = dist.get_world_size(tp_group)
        check_divisible("out_features", out_features, tp)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True with sequence_parallel=True is not supported: "
                             "a sequence-parallel column layer feeds a row-parallel one or a vocab-parallel loss")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp, dist.get_rank(tp_group)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.comm_overlap = comm_overlap and sequence_parallel and tp > 1  # see overlap.py
        rows = {0: (self.tp_rank, tp)}
        self.weight = declare_(_new_param((out_features // tp, in_features), dtype, device), rows)
        self.bias = declare_(nn.Parameter(torch.zeros(out_features // tp, dtype=dtype, device=device)), rows) if bias else None

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """The local matmul on an input already in the TP region (lets several layers share one entry)."""
        return self.linear_kernel(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm_overlap:
            return all_gather_matmul(x, [self.weight], self.tp_group, [self.bias])[0]
        y = self.forward_local(enter_tensor_parallel_region(x, self.tp_group, self.sequence_parallel))
        return gather_from_tensor_parallel_region(y, self.tp_group) if self.gather_output else y

    @torch.no_grad()
    def load_full_(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> "ColumnParallelLinear":
        """Copy this rank's rows of the full ``[out, in]`` weight (and ``[out]`` bias)."""
        self.weight.copy_(shard_tensor(full_weight, 0, self.tp_rank, self.tp_size))
        if self.bias is not None and full_bias is not None:
            self.bias.copy_(shard_tensor(full_bias, 0, self.tp_rank, self.tp_size))
        return self

    def full_weight(self) -> torch.Tensor:
        """The full ``[out, in]`` weight gathered from every rank (collective)."""
        return gather_tensor(self.weight, 0, self.tp_group)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_LoadsFullWeight, _LocalMatmul, nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` split by input columns; the partial sums are reduced over TP.

    Input ``[S, B, in/tp]`` (``input_is_parallel``, the output of a column-parallel layer) or the
    full ``[S, B, in]`` (split here). Output ``[S, B, out]`` all-reduced, or ``[S/tp, B, out]``
    reduce-scattered with ``sequence_parallel``. The bias is added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group: ProcessGroup,
        bias: bool = False,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        comm_overlap: bool = False,
    ):
        super().__init__()
        tp = dist.get_world_size(tp_group)
        check_divisible("in_features", in_features, tp)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True requires input_is_parallel=True "
                             "(the input of a sequence-parallel row layer comes from a column-parallel layer)")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp, dist.get_rank(tp_group)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.comm_overlap = comm_overlap and sequence_parallel and tp > 1  # see overlap.py
        self.weight = declare_(_new_param((out_features, in_features // tp), dtype, device), {1: (self.tp_rank, tp)})
        self.bias = None
        if bias:
            # Replicated; with SP each rank only sees its sequence shard, so its grad is partial.
            self.bias = declare_(nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)),
                                 copies=tp_group, partial_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        if self.comm_overlap:
            y = matmul_reduce_scatter(x, self.weight, self.tp_group)
        else:
            y = exit_tensor_parallel_region(self.linear_kernel(x, self.weight), self.tp_group, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    @torch.no_grad()
    def load_full_(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> "RowParallelLinear":
        """Copy this rank's columns of the full ``[out, in]`` weight (the bias is replicated)."""
        self.weight.copy_(shard_tensor(full_weight, 1, self.tp_rank, self.tp_size))
        if self.bias is not None and full_bias is not None:
            self.bias.copy_(full_bias)
        return self

    def full_weight(self) -> torch.Tensor:
        """The full ``[out, in]`` weight gathered from every rank (collective)."""
        return gather_tensor(self.weight, 1, self.tp_group)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")
