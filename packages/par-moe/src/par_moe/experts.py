"""SwiGLU experts computed as one grouped GEMM over the tokens of all local experts.

Tokens arrive sorted by local expert with ``counts[e]`` rows for expert ``e``. On devices with a
grouped-GEMM kernel (``torch.nn.functional.grouped_mm``: bf16, CUDA SM >= 80 or CPU) each of the
three projections is one grouped matmul; otherwise the rows are scattered into a zero-padded
``[E_local, max_count, H]`` batch and multiplied with one ``bmm``. Either way no Python loop over
experts. Expert tensor parallelism shards the intermediate dimension F: each etp rank holds
``F / etp`` rows of w_gate/w_up and columns of w_down, and returns a partial sum over F.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from par_groups.param_placement import declare_


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM kernel takes these operands (bf16, 16-byte aligned rows)."""
    if not hasattr(F, "grouped_mm") or x.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
        return False
    if any(w.shape[-1] % 8 or w.shape[-2] % 8 for w in weights):
        return False
    if x.is_cuda:
        return torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu"


class GroupLayout:
    """Where each sorted row sits in the padded batch: computed once, used by all three GEMMs."""

    def __init__(self, counts: torch.Tensor, num_rows: int):
        self.counts = counts
        self.num_groups = counts.numel()
        self.offsets = counts.cumsum(0)
        self.group_of_row = torch.repeat_interleave(torch.arange(self.num_groups, device=counts.device), counts)
        starts = self.offsets - counts
        self.pos_in_group = torch.arange(num_rows, device=counts.device) - starts[self.group_of_row]
        self.max_count = int(counts.max().item()) if num_rows else 0


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, layout: GroupLayout, use_grouped_mm: bool) -> torch.Tensor:
    """Row block g of ``x [N, I]`` times ``weight[g].T`` (weight ``[G, O, I]``) -> ``[N, O]``."""
    if use_grouped_mm:
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=layout.offsets.to(torch.int32))
    padded = x.new_zeros(layout.num_groups, layout.max_count, x.shape[-1])
    padded = padded.index_put((layout.group_of_row, layout.pos_in_group), x)
    out = torch.bmm(padded, weight.transpose(1, 2))
    return out[layout.group_of_row, layout.pos_in_group]


class GroupedSwiGLU(nn.Module):
    """``num_experts`` SwiGLU experts: w_gate, w_up ``[E, F, H]`` and w_down ``[E, H, F]``.

    Every parameter's placement says ``expert``: its gradient is reduced over expert DP only.
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

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """tokens ``[N, H]`` sorted by expert, ``counts [E]`` rows per expert -> ``[N, H]``."""
        layout = GroupLayout(counts.to(tokens.device), tokens.shape[0])
        if tokens.shape[0] == 0:
            # Keep every weight in the graph so its (zero) gradient exists on every rank.
            return tokens + 0 * (self.w_gate.sum() + self.w_up.sum() + self.w_down.sum()).to(tokens.dtype)
        fast = grouped_mm_supported(tokens, self.w_gate, self.w_up, self.w_down)
        gate = grouped_linear(tokens, self.w_gate, layout, fast)
        up = grouped_linear(tokens, self.w_up, layout, fast)
        return grouped_linear(F.silu(gate) * up, self.w_down, layout, fast)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)
