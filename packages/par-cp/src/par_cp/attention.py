"""The one entry point the trainer calls: ``ContextParallelAttention(mode, group)(q, k, v)``.

Layout: q ``[S_local, B, Hq, D]``, k/v ``[S_local, B, Hkv, D]``, output ``[S_local, B, Hq, D]``,
where the local sequence is this rank's shard from :func:`par_cp.shard_sequence` with the same
``layout``. ``cu_seqlens`` (document boundaries of the *full* sequence) keeps attention inside
each document: one sequence of boundaries shared by the batch, or a list of B of them, one per
sequence (packed batches, as flash-attn's varlen). Modes are Megatron's cp_comm_type names.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .allgather import allgather_attention
from .hierarchical import hierarchical_attention, hierarchical_cp_rank
from .kernels import BACKENDS
from .kernels.dense import dense_attention
from .ring import ring_attention
from .segments import segment_attention
from .sharding import LAYOUTS, shard_segments
from .ulysses import ulysses_attention

MODES = ("p2p", "a2a", "allgather", "a2a+p2p")


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _bounds(cu_seqlens, seq_len: int) -> tuple[int, ...]:
    bounds = tuple(int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens))
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the full sequence length {seq_len}, got {list(bounds)}")
    return bounds


def _docs(cu_seqlens, seq_len: int, batch: int):
    """None, one boundary tuple for the batch, or a tuple of ``batch`` of them (one per sequence)."""
    if cu_seqlens is None:
        return None
    per_sequence = (not torch.is_tensor(cu_seqlens) and len(cu_seqlens) > 0
                    and (isinstance(cu_seqlens[0], (list, tuple)) or torch.is_tensor(cu_seqlens[0])))
    if not per_sequence:
        return _bounds(cu_seqlens, seq_len)
    if len(cu_seqlens) != batch:
        raise ValueError(f"cu_seqlens has boundaries for {len(cu_seqlens)} sequences; the batch has {batch}")
    docs = tuple(_bounds(c, seq_len) for c in cu_seqlens)
    return docs[0] if len(set(docs)) == 1 else docs  # shared: one pass over the batch


class ContextParallelAttention(torch.nn.Module):
    """Attention over a sequence sharded across a CP group.

    ``cp_group=None`` (or a group of one rank) means no context parallelism: plain attention.
    ``a2a+p2p`` takes ``inner_group`` (Ulysses) and ``outer_group`` (ring) instead, e.g.
    ``groups.hcp[0]`` and ``groups.hcp[1]``. ``backend``: ``auto`` (flash-attn on CUDA, torch's
    fused CPU kernel where it fits, else the pure-PyTorch kernel), ``torch``, ``sdpa``, ``flash``.
    ``dense_on_cpu``: at cp=1 run one torch SDPA call on the CPU too, as a GPU does (``pretrain plan
    --simulate`` measures a GPU's memory on fake CPU tensors); else the CPU takes the block kernels.
    """

    def __init__(self, mode: str = "p2p", cp_group=None, *, inner_group=None, outer_group=None, causal: bool = True,
                 layout: str = "zigzag", softmax_scale: float | None = None, backend: str = "auto",
                 dense_on_cpu: bool = False):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if mode == "a2a+p2p":
            if inner_group is None or outer_group is None:
                raise ValueError("mode='a2a+p2p' needs inner_group (Ulysses) and outer_group (ring), e.g. groups.hcp[0], groups.hcp[1]")
            hcp = _size(inner_group) * _size(outer_group)
            if cp_group is not None and _size(cp_group) != hcp:
                raise ValueError(f"inner*outer={_size(inner_group)}*{_size(outer_group)}={hcp} != cp group size {_size(cp_group)}")
        self.mode, self.cp_group, self.inner_group, self.outer_group = mode, cp_group, inner_group, outer_group
        self.causal, self.layout, self.softmax_scale, self.backend = causal, layout, softmax_scale, backend
        self.dense_on_cpu = dense_on_cpu

    @property
    def cp_rank_and_size(self) -> tuple[int, int]:
        if self.mode == "a2a+p2p":
            return hierarchical_cp_rank(self.inner_group, self.outer_group)
        if _size(self.cp_group) == 1:
            return 0, 1
        return dist.get_rank(self.cp_group), _size(self.cp_group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
            raise ValueError(f"expected q [S, B, Hq, D] and k, v [S, B, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if q.shape[2] % k.shape[2]:
            raise ValueError(f"query heads {q.shape[2]} must be a multiple of key/value heads {k.shape[2]}")
        rank, cp = self.cp_rank_and_size
        seq_len = q.shape[0] * cp
        docs = _docs(cu_seqlens, seq_len, q.shape[1])
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
        args = (self.causal, docs, scale, self.backend)
        if cp == 1:
            if docs is None:  # on a GPU: one fused call (None on the CPU: the block kernels below)
                out = dense_attention(q, k, v, self.causal, scale, self.backend, self.dense_on_cpu)
                if out is not None:
                    return out
            segs = ((0, seq_len),)
            return segment_attention(q, k, v, segs, segs, *args)
        if self.mode == "a2a+p2p":
            return hierarchical_attention(q, k, v, self.inner_group, self.outer_group, seq_len, self.layout, *args)
        segments = [shard_segments(seq_len, r, cp, self.layout) for r in range(cp)]
        run = {"p2p": ring_attention, "a2a": ulysses_attention, "allgather": allgather_attention}[self.mode]
        return run(q, k, v, self.cp_group, segments, *args)


def context_parallel_attention(q, k, v, mode: str = "p2p", cp_group=None, *, cu_seqlens=None, **kwargs) -> torch.Tensor:
    """Function form of :class:`ContextParallelAttention` (same arguments)."""
    return ContextParallelAttention(mode, cp_group, **kwargs)(q, k, v, cu_seqlens)
