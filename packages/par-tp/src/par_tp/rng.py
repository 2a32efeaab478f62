"""Dropout random streams under tensor parallelism.

``TensorParallelRNG`` holds two generators (Megatron's two trackers):
- ``replicated``: the same seed on every TP rank, for dropout on activations every TP rank holds
  (outside TP regions), so the replicas stay identical, and for :func:`sharded_dropout`.
- ``tensor_parallel``: seed + 2718 + tp_rank, a different stream per TP rank, for cheap dropout
  on activations split over ranks (inside TP regions) when matching one device bit for bit is
  not needed.

:func:`sharded_dropout` makes a split activation (sequence shard ``[S/tp, ...]`` or local heads)
drop exactly what one device drops: it draws the full mask from the replicated stream and keeps
this rank's chunk (costs a transient full-size mask, saves none of the math).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

TENSOR_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset for the model-parallel stream


class TensorParallelRNG:
    def __init__(self, seed: int, tp_group: ProcessGroup, device: torch.device | str = "cpu"):
        self.seed, self.tp_rank = seed, dist.get_rank(tp_group)
        self.replicated = torch.Generator(device=device).manual_seed(seed)
        self.tensor_parallel = torch.Generator(device=device).manual_seed(seed + TENSOR_PARALLEL_SEED_OFFSET + self.tp_rank)


def dropout_mask(shape, p: float, generator: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    """Scaled keep-mask: 1/(1-p) with probability 1-p, else 0."""
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1.0 - p, generator=generator).div_(1.0 - p)


def dropout(x: torch.Tensor, p: float, generator: torch.Generator, training: bool = True) -> torch.Tensor:
    """Dropout drawing from ``generator`` (torch's F.dropout cannot take one)."""
    if not training or p == 0.0:
        return x
    return x * dropout_mask(x.shape, p, generator, x.dtype, x.device)


def sharded_dropout(x_shard: torch.Tensor, p: float, generator: torch.Generator, tp_group: ProcessGroup,
                    dim: int = 0, training: bool = True) -> torch.Tensor:
    """Dropout of this rank's chunk along ``dim`` equal to one device's dropout of the full tensor.

    ``generator`` must be identical on every TP rank (``TensorParallelRNG.replicated``).
    """
    if not training or p == 0.0:
        return x_shard
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    full_shape = list(x_shard.shape)
    full_shape[dim] *= tp
    mask = dropout_mask(full_shape, p, generator, x_shard.dtype, x_shard.device).chunk(tp, dim=dim)[rank]
    return x_shard * mask
