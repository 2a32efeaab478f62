"""Autograd-aware collectives of tensor and sequence parallelism, each with its dual backward.

Every collective goes through ``par_groups.comm`` so it can be counted. With a group of one
rank every operator is the identity and communicates nothing.

    name                                   forward                  backward
    copy_to_tensor_parallel_region         identity                 all-reduce
    reduce_from_tensor_parallel_region     all-reduce               identity
    scatter_to_sequence_parallel           split dim 0              all-gather dim 0
    gather_from_sequence_parallel          all-gather dim 0         reduce-scatter dim 0 (or split)
    reduce_scatter_to_sequence_parallel    reduce-scatter dim 0     all-gather dim 0
    gather_from_tensor_parallel_region     all-gather last dim      split last dim
    scatter_to_tensor_parallel_region      split last dim           all-gather last dim
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from par_groups import all_gather_along_dim0, all_gather_dim0, comm, reduce_scatter_along_dim0
from par_groups.autograd import conjugate_pair, identity


def _size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


# ---- raw (non-autograd) primitives along dim 0 / the last dim --------------------------------


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous().clone()
    comm.all_reduce(x, group=group)
    return x


def _split_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {n}")
    # a copy, not a view: a dim-0 chunk is already contiguous, and a view would keep the whole
    # unsplit tensor alive (the embedding's all-reduced output, per micro-batch in flight)
    return x.chunk(n, dim=0)[_rank(group)].clone()


def _split_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {n}")
    return x.chunk(n, dim=-1)[_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    # all_gather_into_tensor stacks along dim 0; move the rank axis to the end afterwards.
    stacked = all_gather_dim0(x.unsqueeze(0), group)  # [n, ..., d]
    return torch.cat(stacked.unbind(0), dim=-1)


# ---- autograd functions: conjugate pairs (the first forwards x and backwards y, the second the reverse)


_CopyToTensorParallelRegion, _ReduceFromTensorParallelRegion = conjugate_pair(
    identity, _all_reduce, ("_CopyToTensorParallelRegion", "_ReduceFromTensorParallelRegion"))
_ScatterToSequenceParallel, _GatherFromSequenceParallelReplicatedGrad = conjugate_pair(
    _split_dim0, all_gather_dim0, ("_ScatterToSequenceParallel", "_GatherFromSequenceParallelReplicatedGrad"))
_GatherFromTensorParallelRegion, _ScatterToTensorParallelRegion = conjugate_pair(
    _gather_last, _split_last, ("_GatherFromTensorParallelRegion", "_ScatterToTensorParallelRegion"))


# ---- public functions ------------------------------------------------------------------------------


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce backward: the entry of a column-parallel region without SP."""
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce forward, identity backward: the exit of a row-parallel region without SP."""
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Split dim 0 (the sequence) forward, all-gather backward: enter SP from a replicated [S, ...]."""
    return _ScatterToSequenceParallel.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group: ProcessGroup, output_grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather dim 0 forward; backward reduce-scatter, or split when the consumer is replicated.

    Use ``output_grad_is_partial=True`` (default) when what follows is tensor-parallel (each rank
    holds part of the input gradient, e.g. a column-parallel layer or a vocab-parallel head) and
    ``False`` when what follows is computed identically on every rank (e.g. a replicated loss).
    """
    if output_grad_is_partial:
        return all_gather_along_dim0(x, group)  # backward: reduce-scatter the partial gradients
    return _GatherFromSequenceParallelReplicatedGrad.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Reduce-scatter dim 0 forward, all-gather backward: the exit of a row-parallel region with SP."""
    return reduce_scatter_along_dim0(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather the last dim forward, split backward (column-parallel ``gather_output``)."""
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Split the last dim forward, all-gather backward (row-parallel with a full input)."""
    return _ScatterToTensorParallelRegion.apply(x, group)


def enter_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """Entry of a column-parallel block: all-gather the sequence (SP) or copy (identity forward)."""
    if sequence_parallel:
        return gather_from_sequence_parallel(x, group)
    return copy_to_tensor_parallel_region(x, group)


def exit_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """Exit of a row-parallel block: reduce-scatter the sequence (SP) or all-reduce."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel(x, group)
    return reduce_from_tensor_parallel_region(x, group)
