"""SwiGLU experts computed as one grouped GEMM over the tokens of all local experts.

Tokens arrive sorted by local expert with ``counts[e]`` rows for expert ``e``. On devices with a
grouped-GEMM kernel (``torch.nn.functional.grouped_mm``: bf16, CUDA SM >= 80 or CPU) each of the
three projections is one grouped matmul (under bf16 autocast the fp32 weights are cast for it); otherwise the rows are scattered into a zero-padded
``[E_local, max_count, H]`` batch and multiplied with one ``bmm``. Either way no Python loop over
experts. Expert tensor parallelism shards the intermediate dimension F: each etp rank holds
``F / etp`` rows of w_gate/w_up and columns of w_down, and returns a partial sum over F.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from par_groups.param_placement import declare_, place_rows_


# torch >= 2.10 names it F.grouped_mm; 2.8/2.9 have the same kernel as torch._grouped_mm
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available(device: torch.device) -> bool:
    """Whether this torch has a grouped GEMM kernel for bf16 operands on ``device``."""
    if _GROUPED_MM is None:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM kernel takes these operands (bf16, or fp32 on the CPU; 16-byte
    aligned rows)."""
    dtypes = (torch.bfloat16, torch.float32) if x.device.type == "cpu" else (torch.bfloat16,)
    if _GROUPED_MM is None or x.dtype not in dtypes or any(w.dtype != x.dtype for w in weights):
        return False
    if any(w.shape[-1] % 8 or w.shape[-2] % 8 for w in weights):
        return False
    return grouped_mm_available(x.device)


class GroupLayout:
    """Where each sorted row sits: the group offsets (all the grouped GEMM needs), and for the padded
    batch each row's group and position, made at first use (once, for all three GEMMs)."""

    def __init__(self, counts: torch.Tensor, num_rows: int, max_count: int | None = None):
        """``max_count``: the largest count when it is known without reading ``counts`` (a declared routing)."""
        self.counts, self.num_rows, self._max_count = counts, num_rows, max_count
        self.num_groups = counts.numel()
        self.offsets = counts.cumsum(0)

    @functools.cached_property
    def group_of_row(self) -> torch.Tensor:
        groups = torch.arange(self.num_groups, device=self.counts.device)
        return torch.repeat_interleave(groups, self.counts, output_size=self.num_rows)

    @functools.cached_property
    def pos_in_group(self) -> torch.Tensor:
        starts = self.offsets - self.counts
        return torch.arange(self.num_rows, device=self.counts.device) - starts[self.group_of_row]

    @functools.cached_property
    def max_count(self) -> int:
        """The padded batch's length; reading it from the counts waits for the GPU (the grouped GEMM never asks)."""
        if self._max_count is not None:
            return self._max_count
        return int(self.counts.max().item()) if self.num_rows else 0


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, layout: GroupLayout, use_grouped_mm: bool) -> torch.Tensor:
    """Row block g of ``x [N, I]`` times ``weight[g].T`` (weight ``[G, O, I]``) -> ``[N, O]``."""
    if use_grouped_mm:
        return _ContiguousGrad.apply(_GROUPED_MM(x, weight.transpose(-2, -1), offs=layout.offsets.to(torch.int32)))
    padded = x.new_zeros(layout.num_groups, layout.max_count, x.shape[-1])
    padded = padded.index_put((layout.group_of_row, layout.pos_in_group), x)
    out = torch.bmm(padded, weight.transpose(1, 2))
    return out[layout.group_of_row, layout.pos_in_group]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: the grouped GEMM's backward refuses an
    expanded one (strides 0, as ``y.sum().backward()`` gives)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedSwiGLU(nn.Module):
    """``num_experts`` SwiGLU experts: w_gate, w_up ``[E, F, H]`` and w_down ``[E, H, F]``.

    Every parameter's placement says ``expert``: its gradient is reduced over expert DP only.
    ``grouped_kernels``: None (the grouped GEMM above), or one ``(x, weight, segments) -> y`` per projection
    (gate, up, down) taking the rows' ``[E_local, sources]`` counts per source rank (FP8: par_tp.fp8).
    ``block = ((ep_rank, ep), (etp_rank, etp))``: these are expert block ``ep_rank`` of ``ep`` and
    F block ``etp_rank`` of ``etp`` of the full ``[E, F, H]`` / ``[E, H, F]`` tensors.
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int,
                 block: tuple[tuple[int, int], tuple[int, int]] = ((0, 1), (0, 1))):
        super().__init__()
        experts, ffn = block
        self.w_gate = declare_(nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden)), {0: experts, 1: ffn}, expert=True)
        self.w_up = declare_(nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden)), {0: experts, 1: ffn}, expert=True)
        self.w_down = declare_(nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden)), {0: experts, 2: ffn}, expert=True)
        nn.init.normal_(self.w_gate, std=hidden ** -0.5)
        nn.init.normal_(self.w_up, std=hidden ** -0.5)
        nn.init.normal_(self.w_down, std=ffn_hidden ** -0.5)
        # Megatron's moe_act recompute: keep gate and up for backward, rerun silu(gate) * up there
        self.recompute_act = False
        self.grouped_kernels = None

    def place_(self, experts: tuple[int, ...]) -> None:
        """Local slot ``i`` holds global expert ``experts[i]`` now (re-placement moved the values)."""
        for w in (self.w_gate, self.w_up, self.w_down):
            place_rows_(w, experts)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, max_count: int | None = None,
                replicas: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """tokens ``[N, H]`` sorted by expert, ``counts [E]`` rows per expert -> ``[N, H]``.
        ``max_count``: the largest of ``counts`` when known without reading them (a declared routing).
        ``replicas``: other ranks' experts' (w_gate, w_up, w_down), computed as experts ``E, E + 1, ...``.
        ``segments``: ``[E, sources]`` rows of each expert from each source rank (default: one source)."""
        weights = (self.w_gate, self.w_up, self.w_down)
        if replicas is not None:
            weights = tuple(torch.cat([w, r]) for w, r in zip(weights, replicas))
        layout = GroupLayout(counts.to(tokens.device), tokens.shape[0], max_count)
        if tokens.shape[0] == 0:
            # Keep every weight in the graph so its (zero) gradient exists on every rank.
            return tokens + 0 * sum(w.sum() for w in weights).to(tokens.dtype)
        if self.grouped_kernels is not None:
            gate, up, down = self.grouped_kernels
            seg = layout.counts.unsqueeze(1) if segments is None else segments
            return down(F.silu(gate(tokens, weights[0], seg)) * up(tokens, weights[1], seg), weights[2], seg)
        tokens, w_gate, w_up, w_down = _autocast_operands(tokens, *weights)
        fast = grouped_mm_supported(tokens, w_gate, w_up, w_down)
        gate = grouped_linear(tokens, w_gate, layout, fast)
        up = grouped_linear(tokens, w_up, layout, fast)
        if self.recompute_act and torch.is_grad_enabled():
            act = checkpoint(_swiglu_act, gate, up, use_reentrant=False)
        else:
            act = _swiglu_act(gate, up)
        return grouped_linear(act, w_down, layout, fast)


def _swiglu_act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, the operands in its dtype, as autocast does for every matmul (fp32 master
    weights get bf16 copies whose grads flow back in fp32): this is what lets the grouped GEMM
    kernel, which autocast does not cover, run in bf16. Outside autocast: unchanged."""
    kind = tensors[0].device.type
    if not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


class SwiGLU(nn.Module):
    """One dense SwiGLU MLP (the shared experts): w_gate, w_up ``[F, H]``, w_down ``[H, F]``."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(ffn_hidden, hidden))
        self.w_up = nn.Parameter(torch.empty(ffn_hidden, hidden))
        self.w_down = nn.Parameter(torch.empty(hidden, ffn_hidden))
        nn.init.normal_(self.w_gate, std=hidden ** -0.5)
        nn.init.normal_(self.w_up, std=hidden ** -0.5)
        nn.init.normal_(self.w_down, std=ffn_hidden ** -0.5)
        self.linear_kernel = F.linear  # ``(x, weight) -> x weight^T``; FP8: par_tp.fp8's kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear_kernel
        return lin(F.silu(lin(x, self.w_gate)) * lin(x, self.w_up), self.w_down)
