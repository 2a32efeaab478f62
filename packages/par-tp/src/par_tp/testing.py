"""A pre-norm transformer block built from the TP layers, for this package's tests and benchmark.

The trainer builds its own block; this one shows the composition and its communication:
``h = x + drop(attn(norm1(x))); y = h + drop(mlp(norm2(h)))`` on ``[S, B, H]``, or on
``[S/tp, B, H]`` with sequence parallelism (norms, dropout and residuals on the sequence shard).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from .attention import TPAttention
from par_groups.param_placement import declare_copies_

from .mlp import TPSwiGLU
from .rng import dropout, sharded_dropout


class TPTransformerBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, ffn_hidden: int, tp_group: ProcessGroup,
                 sequence_parallel: bool = False, dropout_p: float = 0.0, generator: torch.Generator | None = None,
                 comm_overlap: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.dropout_p, self.generator = dropout_p, generator  # generator: identical on all TP ranks
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = TPAttention(hidden, num_heads, num_kv_heads, tp_group, sequence_parallel, comm_overlap=comm_overlap)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = TPSwiGLU(hidden, ffn_hidden, tp_group, sequence_parallel, comm_overlap=comm_overlap)
        for norm in (self.norm1, self.norm2):  # copies on every TP rank; partial grads over sequence shards
            declare_copies_(norm, tp_group, partial_grad=sequence_parallel)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout_p == 0.0 or not self.training:
            return x
        if self.sequence_parallel:
            return sharded_dropout(x, self.dropout_p, self.generator, self.tp_group, dim=0)
        return dropout(x, self.dropout_p, self.generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self._drop(self.attn(self.norm1(x)))
        return h + self._drop(self.mlp(self.norm2(h)))

    @torch.no_grad()
    def load_full_(self, full: dict[str, torch.Tensor]) -> "TPTransformerBlock":
        """Keys: norm1.weight/bias, norm2.weight/bias, wq, wk, wv, wo, w_gate, w_up, w_down (full layouts)."""
        for name in ("norm1", "norm2"):
            getattr(self, name).weight.copy_(full[f"{name}.weight"])
            getattr(self, name).bias.copy_(full[f"{name}.bias"])
        self.attn.load_full_(full["wq"], full["wk"], full["wv"], full["wo"])
        self.mlp.load_full_(full["w_gate"], full["w_up"], full["w_down"])
        return self


def tp_group_of_size(tp: int) -> dist.ProcessGroup:
    """Cut the world into consecutive TP groups of ``tp`` ranks; return this rank's (all ranks must call)."""
    mine = None
    for start in range(0, dist.get_world_size(), tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp32 (Frobenius norms)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
