"""A pre-norm transformer block built from the TP layers, for this package's tests and benchmark.

The trainer builds its own block; this one shows the composition and its communication:
``h = x + attn(norm1(x)); y = h + mlp(norm2(h))`` on ``[S, B, H]``, or on ``[S/tp, B, H]`` with
sequence parallelism (norms and residuals on the sequence shard). After the backward, the grads of
parameters copied over TP but fed a shard are partial: :func:`sum_partial_grads_of_` sums them
(in the trainer par-zero's DataParallel does, from the same declared placements).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from par_groups.param_placement import declare_copies_, placement_of, sum_partial_grads_

from .attention import TPAttention
from .mlp import TPSwiGLU


class TPTransformerBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, ffn_hidden: int, tp_group: ProcessGroup,
                 sequence_parallel: bool = False, comm_overlap: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = TPAttention(hidden, num_heads, num_kv_heads, tp_group, sequence_parallel, comm_overlap=comm_overlap)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = TPSwiGLU(hidden, ffn_hidden, tp_group, sequence_parallel, comm_overlap=comm_overlap)
        for norm in (self.norm1, self.norm2):  # copies on every TP rank; partial grads over sequence shards
            declare_copies_(norm, tp_group, partial_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))

    @torch.no_grad()
    def load_full_(self, full: dict[str, torch.Tensor]) -> "TPTransformerBlock":
        """Keys: norm1.weight/bias, norm2.weight/bias, wq, wk, wv, wo, w_gate, w_up, w_down (full layouts)."""
        for name in ("norm1", "norm2"):
            getattr(self, name).weight.copy_(full[f"{name}.weight"])
            getattr(self, name).bias.copy_(full[f"{name}.bias"])
        self.attn.load_full_(full["wq"], full["wk"], full["wv"], full["wo"])
        self.mlp.load_full_(full["w_gate"], full["w_up"], full["w_down"])
        return self


def sum_partial_grads_of_(module: nn.Module) -> int:
    """Sum the partial grads of ``module``'s copied parameters over their copies (one all-reduce per
    group; Megatron's ``finalize_model_grads`` for TP); returns how many were summed."""
    return sum_partial_grads_([(p.grad, placement_of(p)) for p in module.parameters() if p.grad is not None])


def counted_grad_norm_sq(module: nn.Module) -> torch.Tensor:
    """This rank's share of the squared grad norm (each block counted on one copy): summed over TP,
    the full model's."""
    shares = [p.grad.float().pow(2).sum() for p in module.parameters() if p.grad is not None and placement_of(p).counted()]
    return torch.stack(shares).sum()


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
