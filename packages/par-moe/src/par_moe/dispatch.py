"""Token dispatchers: bring each token to the EP ranks holding its experts, and the results back.

EP rank ``p`` of a group of ``P`` holds experts ``[p * E/P, (p + 1) * E/P)``. ``dispatch`` returns
the rows for this rank's experts sorted by local expert, their per-expert counts and a handle;
``combine`` takes the experts' output rows, weights them by the routing weights and sums each
token's k contributions.

* :class:`AllToAllDispatcher`: each token is sent once per destination rank (not once per
  expert): counts per rank first (one small all-to-all), then ``all_to_all_single`` with split
  sizes moves the rows with their slots' weights and local expert ids. The expert side expands
  rows to experts, and on combine weights and sums each row's experts there, so one row per
  (token, rank) comes back; the source adds its token's rows. The weighted sum is the one a
  single device computes, grouped by rank.
* :class:`AllGatherDispatcher`: every rank gathers all tokens of the EP group (and routing),
  computes its experts' share of every token, then a reduce-scatter sums the shares and hands
  each rank its own tokens. Needs the same token count on every EP rank.
* ``PaddedAllToAllDispatcher`` (padded.py): static shapes, every expert padded to its capacity.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from .comm import (all_to_all_tokens, exchange_counts, gather_no_grad, gather_tokens, group_rank, group_size,
                   reduce_scatter_tokens)
from .declared import RoutedSizes, bincount, nonzero


@dataclass
class DispatchHandle:
    """What ``combine`` needs to undo a ``dispatch``."""

    num_tokens: int  # rows the expert outputs are summed into (tokens; all-to-all: received rows)
    token_of_row: torch.Tensor  # which of those rows each expert row belongs to
    weight_of_row: torch.Tensor  # combine weight of each expert row (differentiable)
    input_splits: list[int] | None = None  # all-to-all: rows sent to each rank
    output_splits: list[int] | None = None  # all-to-all: rows received from each rank
    source_token: torch.Tensor | None = None  # all-to-all: the token of each sent row
    num_source_tokens: int = 0
    max_count: int | None = None  # the most rows of one local expert, when known without a host read
    source_ends: list[int] | None = None  # where each source rank's rows end in token_of_row's numbering


def source_segments(handle: DispatchHandle, counts: torch.Tensor) -> torch.Tensor:
    """``[E_local, sources]``: the expert rows of each local expert from each source rank. Within an expert the
    rows are in source order (a stable sort of rows received by source), so these split each expert's rows
    into the sources' own."""
    if handle.source_ends is None:
        return counts.unsqueeze(1)
    ends = torch.tensor(handle.source_ends, device=counts.device)
    source = torch.bucketize(handle.token_of_row, ends, right=True)
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                     output_size=handle.token_of_row.numel())
    sources = len(handle.source_ends)
    return torch.bincount(expert * sources + source, minlength=counts.numel() * sources).view(-1, sources)


def sort_pairs(indices: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None,
               experts: tuple[int, int] | None = None, size: int | None = None):
    """Kept (token, slot) pairs [whose expert is in ``experts=[lo, hi)``] sorted stably by expert.

    Returns (expert id, token id, weight) per pair, in sorted order. ``size``: their number, when
    declared (see ``declared.py``).
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
        (selected,) = nonzero(mask, size)
        flat_e, flat_t, flat_w = flat_e[selected], flat_t[selected], flat_w[selected]
    order = torch.argsort(flat_e, stable=True)
    return flat_e[order], flat_t[order], flat_w[order]


def weighted_sum(rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Sum each token's weighted expert rows into ``[num_tokens, H]``."""
    out = rows.new_zeros(handle.num_tokens, rows.shape[-1])
    return out.index_add(0, handle.token_of_row, rows * handle.weight_of_row.to(rows.dtype).unsqueeze(-1))


class AllToAllDispatcher:
    """Dispatch by all-to-all over ``ep_group`` (None or size 1: local permute only).

    A token goes once to each EP rank holding any of its experts (not once per expert), with
    its k slots' local expert ids and weights beside it; that rank expands the row to its
    experts, weights their outputs and sums them, and sends one row back per row received; the
    source sums the rows of each token.
    """

    def __init__(self, num_experts: int, ep_group: ProcessGroup | None):
        self.group = ep_group
        self.ep = group_size(ep_group)
        self.num_local = num_experts // self.ep
        self.num_experts = num_experts

    def routed_sizes(self, indices: torch.Tensor, kept: torch.Tensor, needs: torch.Tensor) -> RoutedSizes:
        """The sizes of this dispatch from the routing with ONE host read: the rows for each destination
        and the pairs for each of its experts go out in one small all-to-all, and what was sent and
        received is read together. A GPU waits once per MoE layer and micro-batch; every later shape
        (the token rows, the all-to-all, the expert rows, the padded batch) is then known."""
        sent, got = self._exchange_counts(indices, kept, needs).tolist()  # the one host read
        return RoutedSizes(pairs=[n for row in sent for n in row[1:]], send=[row[0] for row in sent],
                           receive=[row[0] for row in got], local=[sum(col) for col in zip(*(row[1:] for row in got))])

    def _exchange_counts(self, indices, kept, needs) -> torch.Tensor:
        """[2, ep, 1 + local]: the rows for each rank and pairs for each of its experts, sent and received."""
        pairs = torch.zeros(self.ep * self.num_local, dtype=torch.int64, device=indices.device)
        pairs = pairs.scatter_add_(0, indices.reshape(-1), kept.reshape(-1).to(torch.int64))
        out = torch.cat([needs.sum(0, dtype=torch.int64).unsqueeze(1), pairs.view(self.ep, self.num_local)], dim=1)
        received = exchange_counts(out.reshape(-1), self.group).view(self.ep, 1 + self.num_local)
        return torch.stack([out, received])

    def dispatch(self, x, indices, weights, keep=None, sizes: RoutedSizes | None = None):
        """``sizes``: a declared routing's sizes in place of the data's (None: the data's, read once)."""
        declared = None if sizes is None else sizes.local  # counts to build on the host (no data to count)
        if self.ep == 1:
            expert, token, weight = sort_pairs(indices, weights, keep, size=None if declared is None else sum(declared))
            return x[token], bincount(expert, self.num_experts, declared), DispatchHandle(x.shape[0], token, weight)
        hidden, top_k = x.shape[1], indices.shape[1]
        rank_of_slot = indices // self.num_local  # [T, k]
        kept = torch.ones_like(indices, dtype=torch.bool) if keep is None else keep
        # needs[t, p]: token t has a kept slot on rank p (a scatter, not a masked index: static shapes)
        needs = torch.zeros(x.shape[0], self.ep, dtype=torch.int32, device=x.device)
        needs = needs.scatter_add_(1, rank_of_slot, kept.to(torch.int32)) > 0
        if sizes is None:
            sizes = self.routed_sizes(indices, kept, needs)
        else:  # a declared routing (plan --simulate) exchanges its counts too, as a real run does; reads nothing
            self._exchange_counts(indices, kept, needs)
        local = sizes.local
        # one row per (destination rank, token), by rank
        dest, token = nonzero(needs.t(), sum(sizes.send))
        # Each row carries its k slots: the weight and local expert id of the slots bound for dest, else 0 / -1.
        mine = (rank_of_slot[token] == dest.unsqueeze(1)) & kept[token]
        slot_weight = torch.where(mine, weights[token], 0.0).to(x.dtype)
        slot_expert = torch.where(mine, indices[token] - dest.unsqueeze(1) * self.num_local, -1)
        payload = torch.cat([x[token], slot_weight, _ids_as(slot_expert, x.dtype)], dim=1)
        input_splits, output_splits = sizes.send, sizes.receive
        received = all_to_all_tokens(payload, self.group, output_splits, input_splits)
        # Expand each received row to its local experts, sorted by expert.
        rows_x, rows_w = received[:, :hidden], received[:, hidden:hidden + top_k]
        rows_e = _ids_from(received[:, hidden + top_k:], torch.int64)
        row, slot = nonzero(rows_e >= 0, sum(local))
        expert = rows_e[row, slot]
        order = torch.argsort(expert, stable=True)
        row, slot, expert = row[order], slot[order], expert[order]
        handle = DispatchHandle(received.shape[0], row, rows_w[row, slot], input_splits=input_splits,
                                output_splits=output_splits, source_token=token, num_source_tokens=x.shape[0],
                                max_count=max(local), source_ends=list(itertools.accumulate(output_splits)))
        return rows_x[row], bincount(expert, self.num_local, declared), handle

    def combine(self, expert_out, handle: DispatchHandle):
        per_row = weighted_sum(expert_out, handle)  # each received row's experts, weighted and summed
        if self.ep == 1:
            return per_row
        returned = all_to_all_tokens(per_row, self.group, handle.input_splits, handle.output_splits)
        return returned.new_zeros(handle.num_source_tokens, returned.shape[1]).index_add(0, handle.source_token, returned)


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # per float size: bf16/fp16, fp32, fp64


def _ids_as(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Small integer ids as columns of a floating ``dtype`` (bit-cast, so they travel with the rows)."""
    return ids.to(_INT_OF_SIZE[dtype.itemsize]).view(dtype)


def _ids_from(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo :func:`_ids_as`."""
    return columns.detach().contiguous().view(_INT_OF_SIZE[columns.dtype.itemsize]).to(dtype)


class AllGatherDispatcher:
    """Dispatch by all-gather of the EP group's tokens, combine by reduce-scatter."""

    def __init__(self, num_experts: int, ep_group: ProcessGroup | None):
        self.group = ep_group
        self.ep = group_size(ep_group)
        self.num_local = num_experts // self.ep
        self.first = group_rank(ep_group) * self.num_local

    def dispatch(self, x, indices, weights, keep=None, sizes: RoutedSizes | None = None):
        """``sizes``: a declared routing's sizes in place of the data's (None: the data's)."""
        local = None if sizes is None else sizes.local
        if self.ep > 1:
            x = gather_tokens(x, self.group)
            weights = gather_tokens(weights, self.group)
            indices = gather_no_grad(indices, self.group)
            keep = None if keep is None else gather_no_grad(keep, self.group)
        expert, token, weight = sort_pairs(indices, weights, keep, (self.first, self.first + self.num_local),
                                           None if local is None else sum(local))
        counts = bincount(expert - self.first, self.num_local, local)
        per_rank = x.shape[0] // self.ep  # the gathered tokens, by source rank (equal counts)
        return x[token], counts, DispatchHandle(x.shape[0], token, weight,
                                                source_ends=[per_rank * (i + 1) for i in range(self.ep)])

    def combine(self, expert_out, handle: DispatchHandle):
        partial = weighted_sum(expert_out, handle)
        return partial if self.ep == 1 else reduce_scatter_tokens(partial, self.group)


def make_dispatcher(kind: str, num_experts: int, ep_group: ProcessGroup | None):
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, ep_group)
    if kind == "alltoall_padded":
        from .padded import PaddedAllToAllDispatcher

        return PaddedAllToAllDispatcher(num_experts, ep_group)
    raise ValueError(f"dispatcher {kind!r}; use 'alltoall', 'allgather' or 'alltoall_padded'")
