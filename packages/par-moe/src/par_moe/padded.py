"""Static-shape dispatch (``dispatcher = "alltoall_padded"``, Megatron's
``--moe-pad-expert-input-to-capacity``): every expert receives exactly ``slots`` rows from every EP
rank, zeros where it was routed fewer, so no size depends on the routing and nothing is read on
the host: a GPU never waits for the router (the data-dependent all-to-all reads its split sizes
once per layer and micro-batch, ``AllToAllDispatcher.routed_sizes``).

``slots`` is the expert capacity (``capacity_factor``: pairs past it were dropped before dispatch),
or, dropless, this rank's token count (a token reaches an expert at most once), so nothing is
dropped and the result is the dropless math: padding rows are zeros, a SwiGLU maps them to zeros,
and they are never combined. Each (token, expert) pair sits at its position among the expert's
pairs in token order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from .comm import all_to_all_tokens, group_size


@dataclass
class PaddedHandle:
    """What ``combine`` needs: where each (token, slot) pair went, and its combine weight."""

    num_tokens: int
    token_of_pair: torch.Tensor  # [T * k]
    row_of_pair: torch.Tensor  # [T * k]: its row in the [E * slots] buffer; E * slots for a dropped pair
    weight_of_pair: torch.Tensor  # [T * k], 0 for a dropped pair (differentiable)
    slots: int
    max_count: int  # rows per local expert: ep * slots


class PaddedAllToAllDispatcher:
    """All-to-all with equal, routing-independent splits: ``num_experts / ep * slots`` rows per rank."""

    def __init__(self, num_experts: int, ep_group: ProcessGroup | None):
        self.group, self.ep = ep_group, group_size(ep_group)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep

    def dispatch(self, x, indices, weights, keep=None, sizes=None, slots: int | None = None):
        """``x [T, H]`` -> (rows ``[num_local * ep * slots, H]`` by local expert, then source rank,
        then position; every local expert's row count; the handle)."""
        if sizes is not None:
            raise ValueError("the padded dispatcher has static shapes: it takes no declared sizes")
        tokens, top_k = indices.shape
        slots = tokens if slots is None else slots
        kept = torch.ones_like(indices, dtype=torch.bool) if keep is None else keep
        expert, ok = indices.reshape(-1), kept.reshape(-1)
        # position among the expert's kept pairs, in token order (a cumulative count: no host read)
        onehot = F.one_hot(expert, self.num_experts) * ok.unsqueeze(1)
        position = (onehot.cumsum(0) - 1).gather(1, expert.unsqueeze(1)).squeeze(1)
        ok = ok & (position < slots)
        row = torch.where(ok, expert * slots + position, self.num_experts * slots)  # the last row: a drop
        token = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
        buffer = x.new_zeros(self.num_experts * slots + 1, x.shape[1]).index_add(0, row, x[token])
        buffer = buffer[:-1]
        if self.ep > 1:  # rank p receives its experts' blocks from every rank
            split = [self.num_local * slots] * self.ep
            buffer = all_to_all_tokens(buffer, self.group, split, split)
        rows = buffer.view(self.ep, self.num_local, slots, -1).transpose(0, 1).reshape(-1, x.shape[1])
        counts = torch.full((self.num_local,), self.ep * slots, dtype=torch.int64, device=x.device)
        weight = torch.where(ok, weights.reshape(-1), 0.0)
        return rows, counts, PaddedHandle(tokens, token, row, weight, slots, self.ep * slots)

    def combine(self, expert_out: torch.Tensor, handle: PaddedHandle) -> torch.Tensor:
        hidden = expert_out.shape[-1]
        out = expert_out.view(self.num_local, self.ep, handle.slots, hidden).transpose(0, 1).reshape(-1, hidden)
        if self.ep > 1:
            split = [self.num_local * handle.slots] * self.ep
            out = all_to_all_tokens(out, self.group, split, split)
        out = torch.cat([out, out.new_zeros(1, hidden)])  # the drop row
        pairs = out[handle.row_of_pair] * handle.weight_of_pair.to(out.dtype).unsqueeze(1)
        return pairs.new_zeros(handle.num_tokens, hidden).index_add(0, handle.token_of_pair, pairs)
