"""Tensor-parallel attention projections: query/KV heads split over TP ranks, output row-parallel.

Full weight layout (Llama / Hugging Face, heads contiguous and head-major along the rows):
``wq [Hq*D, H]``, ``wk [Hkv*D, H]``, ``wv [Hkv*D, H]``, ``wo [H, Hq*D]``.

Rank r holds query heads ``[r*Hq/tp, (r+1)*Hq/tp)``. KV heads (grouped-query attention) are split
the same way when tp divides Hkv; when Hkv < tp each rank holds the one KV head its query heads
use, so each KV head is replicated on ``tp/Hkv`` ranks. Those replicas see only their own query
heads' gradient: their placement declares them partial copies, and their grads are summed by
``par_groups.sum_partial_grads_`` (par-zero's data-parallel wrapper calls it), so replicas stay identical.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from par_groups.param_placement import declare_

from .comm import enter_tensor_parallel_region
from .overlap import all_gather_matmul
from .layers import ColumnParallelLinear, RowParallelLinear
from .sharding import check_divisible, gather_kv_heads, kv_head_layout, shard_kv_heads

AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal softmax attention with GQA: q ``[S, B, hq, D]``, k/v ``[S, B, hkv, D]`` -> ``[S, B, hq, D]``."""
    group = q.shape[2] // k.shape[2]
    if group > 1:  # query head i uses KV head i // group
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, h, S, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]))
    return out.permute(2, 0, 1, 3)


def validate_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raise a ValueError naming the head counts and the TP sizes that would work."""
    check_divisible("num_heads", num_heads, tp_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}")
    kv_head_layout(num_kv_heads, tp_size)


class TPAttention(nn.Module):
    """Self-attention with heads split over TP ranks; ``core(q, k, v)`` does the attention itself.

    Input/output ``[S, B, hidden]``, or ``[S/tp, B, hidden]`` with ``sequence_parallel``. ``core``
    receives q ``[S_any, B, Hq/tp, D]`` and k, v ``[S_any, B, Hkv_local, D]`` and returns
    ``[S_any, B, Hq/tp, D]`` (inject RoPE and context parallelism there); default
    :func:`causal_attention`. Communication as a column-then-row block: one entry, one exit.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        tp_group: ProcessGroup,
        sequence_parallel: bool = False,
        core: AttentionCore | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        comm_overlap: bool = False,
    ):
        super().__init__()
        tp = dist.get_world_size(tp_group)
        validate_heads(num_heads, num_kv_heads, tp)
        self.head_dim = head_dim or hidden // num_heads
        if head_dim is None and hidden % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide hidden={hidden}; pass head_dim")
        self.hidden, self.num_heads, self.num_kv_heads = hidden, num_heads, num_kv_heads
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp, dist.get_rank(tp_group)
        self.sequence_parallel = sequence_parallel
        self.core = core or causal_attention
        self.local_heads = num_heads // tp
        self.local_kv_heads, self.kv_replicas = kv_head_layout(num_kv_heads, tp)
        d, kw = self.head_dim, dict(dtype=dtype, device=device)
        self.wq = ColumnParallelLinear(hidden, num_heads * d, tp_group, sequence_parallel=sequence_parallel,
                                       comm_overlap=comm_overlap, **kw)
        # KV projections hold this rank's local_kv_heads heads (a shard, or a replica when Hkv < tp).
        self.wk = self._kv_projection(hidden, **kw)
        self.wv = self._kv_projection(hidden, **kw)
        self.wo = RowParallelLinear(num_heads * d, hidden, tp_group, input_is_parallel=True, sequence_parallel=sequence_parallel,
                                    comm_overlap=comm_overlap, **kw)
        self.comm_overlap = self.wo.comm_overlap

    def _kv_projection(self, hidden: int, dtype, device) -> nn.Linear:
        proj = nn.Linear(hidden, self.local_kv_heads * self.head_dim, bias=False, dtype=dtype, device=device)
        nn.init.normal_(proj.weight, 0.0, 0.02)
        r = self.kv_replicas  # > 1: identical copies on r consecutive ranks, each with its query heads' grad
        declare_(proj.weight, {0: (self.tp_rank // r, self.tp_size // r)}, copies=self.tp_group, span=r, partial_grad=True)
        return proj

    def forward(self, x: torch.Tensor, **core_args) -> torch.Tensor:
        """``core_args`` go to ``core`` (e.g. the document boundaries of packed sequences)."""
        q, k, v = self.project(x)
        s, b = q.shape[0], q.shape[1]
        q = q.view(s, b, self.local_heads, self.head_dim)
        k = k.view(s, b, self.local_kv_heads, self.head_dim)
        v = v.view(s, b, self.local_kv_heads, self.head_dim)
        out = self.core(q, k, v, **core_args)
        return self.wo(out.reshape(s, b, self.local_heads * self.head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q, k, v ``[S, B, heads * D]``: the one entry collective, then the local matmuls.
        A backend may replace it on an instance (pretrain's TE backend moves the input norm in here)."""
        if self.comm_overlap:  # q, k, v share one gather, overlapped with their matmuls
            return all_gather_matmul(x, [self.wq.weight, self.wk.weight, self.wv.weight], self.tp_group)
        x = enter_tensor_parallel_region(x, self.tp_group, self.sequence_parallel)  # one entry for q, k, v
        return self.wq.forward_local(x), self.wk(x), self.wv(x)

    @torch.no_grad()
    def load_full_(self, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor) -> "TPAttention":
        """Copy this rank's heads of the full ``wq [Hq*D, H]``, ``wk/wv [Hkv*D, H]``, ``wo [H, Hq*D]``."""
        self.wq.load_full_(wq)
        self.wk.weight.copy_(shard_kv_heads(wk, self.num_kv_heads, self.tp_rank, self.tp_size))
        self.wv.weight.copy_(shard_kv_heads(wv, self.num_kv_heads, self.tp_rank, self.tp_size))
        self.wo.load_full_(wo)
        return self

    def full_weights(self) -> dict[str, torch.Tensor]:
        """``{"wq", "wk", "wv", "wo"}`` in the full layout, gathered from every rank (collective)."""
        return {
            "wq": self.wq.full_weight(),
            "wk": gather_kv_heads(self.wk.weight, self.num_kv_heads, self.tp_group),
            "wv": gather_kv_heads(self.wv.weight, self.num_kv_heads, self.tp_group),
            "wo": self.wo.full_weight(),
        }
