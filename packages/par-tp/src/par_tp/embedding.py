"""Vocab-parallel embedding: each TP rank owns a contiguous range of vocabulary rows."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from par_groups.param_placement import declare_

from .comm import exit_tensor_parallel_region
from .sharding import check_divisible, gather_tensor, shard_tensor


class VocabParallelEmbedding(nn.Module):
    """Rows ``[V/tp * r, V/tp * (r+1))`` of the ``[V, dim]`` table on TP rank r.

    Ids outside this rank's range look up zeros; the partial embeddings are summed over the group
    (all-reduce), or reduce-scattered along dim 0 with ``sequence_parallel`` so ids ``[S, B]``
    give ``[S/tp, B, dim]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        tp_group: ProcessGroup,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = dist.get_world_size(tp_group)
        check_divisible("num_embeddings (vocabulary size)", num_embeddings, tp)
        self.num_embeddings, self.dim = num_embeddings, dim
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp, dist.get_rank(tp_group)
        self.sequence_parallel = sequence_parallel
        per_rank = num_embeddings // tp
        self.vocab_start, self.vocab_end = self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank
        weight = torch.empty(per_rank, dim, dtype=dtype, device=device).normal_(0.0, 0.02)
        self.weight = declare_(nn.Parameter(weight), {0: (self.tp_rank, tp)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp_size == 1:
            # The exit would be the identity, whose autograd output is a view; FSDP2 warns about a
            # unit returning a view (an in-place op on it would skip its pre-backward hook), so the
            # embedding, a gather unit of its own, returns the fresh tensor instead.
            return partial
        return exit_tensor_parallel_region(partial, self.tp_group, self.sequence_parallel)

    @torch.no_grad()
    def load_full_(self, full_weight: torch.Tensor) -> "VocabParallelEmbedding":
        """Copy this rank's vocabulary rows of the full ``[V, dim]`` table."""
        self.weight.copy_(shard_tensor(full_weight, 0, self.tp_rank, self.tp_size))
        return self

    def full_weight(self) -> torch.Tensor:
        """The full ``[V, dim]`` table gathered from every rank (collective)."""
        return gather_tensor(self.weight, 0, self.tp_group)

    @classmethod
    def from_full(cls, full_weight: torch.Tensor, tp_group: ProcessGroup, **kw) -> "VocabParallelEmbedding":
        v, d = full_weight.shape
        return cls(v, d, tp_group, dtype=full_weight.dtype, device=full_weight.device, **kw).load_full_(full_weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
