"""Token dispatchers: send each (token, expert) pair to the EP rank holding the expert, and back.

EP rank ``p`` of a group of ``P`` holds experts ``[p * E/P, (p + 1) * E/P)``. ``dispatch`` returns
the rows for this rank's experts sorted by local expert, their per-expert counts and a handle;
``combine`` takes the experts' output rows, brings them home, weights them and sums each
token's k contributions.

* :class:`AllToAllDispatcher`: pairs are permuted by expert, counts are exchanged first (one
  small all-to-all), then ``all_to_all_single`` with split sizes moves only the routed rows;
  on return the reverse all-to-all, un-permute, weight, sum.
* :class:`AllGatherDispatcher`: every rank gathers all tokens of the EP group (and routing),
  computes its experts' share of every token, then a reduce-scatter sums the shares and hands
  each rank its own tokens. Needs the same token count on every EP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from .comm import (all_to_all_tokens, exchange_counts, gather_no_grad, gather_tokens, group_rank, group_size,
                   reduce_scatter_tokens)


@dataclass
class DispatchHandle:
    """What ``combine`` needs to undo a ``dispatch``."""

    num_tokens: int  # rows of the tensor combine returns into
    token_of_row: torch.Tensor  # token index of each sent/selected row
    weight_of_row: torch.Tensor  # combine weight of each row (differentiable)
    unsort: torch.Tensor | None = None  # received order <- expert-sorted order (all-to-all)
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None


def sort_pairs(indices: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None, experts: tuple[int, int] | None = None):
    """Kept (token, slot) pairs [whose expert is in ``experts=[lo, hi)``] sorted stably by expert.

    Returns (expert id, token id, weight) per pair, in sorted order.
    """
    tokens, top_k = indices.shape
    flat_e = indices.reshape(-1)
    flat_t = torch.arange(tokens, device=indices.device).repeat_interleave(top_k)
    flat_w = weights.reshape(-1)
    mask = None if keep is None else keep.reshape(-1)
    if experts is not None:
        in_range = (flat_e >= experts[0]) & (flat_e < experts[1])
        mask = in_range if mask is None else mask & in_range
    if mask is not None:
        selected = mask.nonzero().squeeze(1)
        flat_e, flat_t, flat_w = flat_e[selected], flat_t[selected], flat_w[selected]
    order = torch.argsort(flat_e, stable=True)
    return flat_e[order], flat_t[order], flat_w[order]


def weighted_sum(rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Sum each token's weighted expert rows into ``[num_tokens, H]``."""
    out = rows.new_zeros(handle.num_tokens, rows.shape[-1])
    return out.index_add(0, handle.token_of_row, rows * handle.weight_of_row.to(rows.dtype).unsqueeze(-1))


class AllToAllDispatcher:
    """Dispatch by all-to-all over ``ep_group`` (None or size 1: local permute only)."""

    def __init__(self, num_experts: int, ep_group: ProcessGroup | None):
        self.group = ep_group
        self.ep = group_size(ep_group)
        self.num_local = num_experts // self.ep
        self.num_experts = num_experts

    def dispatch(self, x, indices, weights, keep=None):
        expert, token, weight = sort_pairs(indices, weights, keep)
        counts = torch.bincount(expert, minlength=self.num_experts)
        handle = DispatchHandle(x.shape[0], token, weight)
        sent = x[token]
        if self.ep == 1:
            return sent, counts, handle
        # Counts first, so every rank knows how many rows it receives from whom.
        received_counts = exchange_counts(counts, self.group).view(self.ep, self.num_local)
        handle.input_splits = counts.view(self.ep, self.num_local).sum(1).tolist()
        handle.output_splits = received_counts.sum(1).tolist()
        received = all_to_all_tokens(sent, self.group, handle.output_splits, handle.input_splits)
        # Rows arrive grouped by (source rank, local expert); regroup by local expert.
        local_expert = torch.arange(self.num_local, device=x.device).repeat(self.ep)
        expert_of_row = torch.repeat_interleave(local_expert, received_counts.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        handle.unsort = torch.empty_like(by_expert).scatter_(0, by_expert, torch.arange(by_expert.numel(), device=x.device))
        return received[by_expert], received_counts.sum(0), handle

    def combine(self, expert_out, handle: DispatchHandle):
        if self.ep == 1:
            return weighted_sum(expert_out, handle)
        returned = all_to_all_tokens(expert_out[handle.unsort], self.group, handle.input_splits, handle.output_splits)
        return weighted_sum(returned, handle)


class AllGatherDispatcher:
    """Dispatch by all-gather of the EP group's tokens, combine by reduce-scatter."""

    def __init__(self, num_experts: int, ep_group: ProcessGroup | None):
        self.group = ep_group
        self.ep = group_size(ep_group)
        self.num_local = num_experts // self.ep
        self.first = group_rank(ep_group) * self.num_local

    def dispatch(self, x, indices, weights, keep=None):
        if self.ep > 1:
            x = gather_tokens(x, self.group)
            weights = gather_tokens(weights, self.group)
            indices = gather_no_grad(indices, self.group)
            keep = None if keep is None else gather_no_grad(keep, self.group)
        expert, token, weight = sort_pairs(indices, weights, keep, (self.first, self.first + self.num_local))
        counts = torch.bincount(expert - self.first, minlength=self.num_local)
        return x[token], counts, DispatchHandle(x.shape[0], token, weight)

    def combine(self, expert_out, handle: DispatchHandle):
        partial = weighted_sum(expert_out, handle)
        return partial if self.ep == 1 else reduce_scatter_tokens(partial, self.group)


def make_dispatcher(kind: str, num_experts: int, ep_group: ProcessGroup | None):
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, ep_group)
    raise ValueError(f"dispatcher {kind!r}; use 'alltoall' or 'allgather'")
