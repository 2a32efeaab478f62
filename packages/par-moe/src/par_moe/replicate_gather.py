"""Balanced dispatch for the all-gather dispatcher (``expert_balance = "replicate"``, ``dispatcher = "allgather"``).

Under all-gather every EP rank already holds every token of the group, so balancing moves no token:
only the hot experts' weights travel (:func:`~par_moe.replicate.fetch_replicas`, their gradients
back home). The plan (:mod:`~par_moe.balance`) comes from the gathered routing itself, counted on
every rank alike (one host read, no extra collective): each rank then computes, of each expert's
pairs (ordered by source rank, then token: the gathered order), the range the plan gives it, in
its slots' order (home experts, then replicas by expert). The combine's reduce-scatter sums every
rank's share of a token, as the plain all-gather dispatcher does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .balance import ReplicaPlan
from .comm import gather_no_grad, gather_tokens, reduce_scatter_tokens
from .declared import RoutedSizes
from .dispatch import DispatchHandle, sort_pairs, weighted_sum
from .replicate import BalancedDispatcher


@dataclass
class GatheredReplicaHandle(DispatchHandle):
    plan: ReplicaPlan | None = None


class ReplicatingAllGatherDispatcher(BalancedDispatcher):
    """All-gather dispatch over ``ep_group`` balanced by replicas (at most ``max_replicas`` per rank)."""

    def plan(self, indices: torch.Tensor, kept: torch.Tensor, declared: list[int] | None) -> ReplicaPlan:
        """The pairs each source rank routes to each expert, from the gathered routing (every rank alike)."""
        if declared is not None:  # a declared routing: every rank's pairs alike, nothing to read
            return self.plan_from([declared] * self.ep)
        source = torch.arange(self.ep, device=indices.device).repeat_interleave(indices.numel() // self.ep)
        key = source * self.num_experts + indices.reshape(-1)
        counts = torch.zeros(self.ep * self.num_experts, dtype=torch.int64, device=indices.device)
        counts = counts.scatter_add_(0, key, kept.reshape(-1).to(torch.int64)).view(self.ep, self.num_experts)
        return self.plan_from(counts.tolist())  # the one host read

    def dispatch(self, x, indices, weights, keep=None, sizes: RoutedSizes | None = None):
        """Rows for this rank's slots sorted by slot, their counts per slot, the handle."""
        x, weights = gather_tokens(x, self.group), gather_tokens(weights, self.group)
        indices = gather_no_grad(indices, self.group)
        keep = None if keep is None else gather_no_grad(keep, self.group)
        kept = torch.ones_like(indices, dtype=torch.bool) if keep is None else keep
        plan = self.last_plan = self.plan(indices, kept, None if sizes is None else sizes.pairs)
        per_expert = [sum(col) for col in zip(*plan.counts)]
        _, token, weight = sort_pairs(indices, weights, keep, size=sum(per_expert))  # by expert, then gathered token
        me, first = self.rank, self.rank * self.num_local
        slots = list(range(first, first + self.num_local)) + list(plan.replicas[me])
        ranges, counts = [], []  # this rank's range of each slot's expert, in slot order
        for e in slots:
            at = sum(per_expert[:e])
            for rank, n in plan.segments[e]:
                if rank == me:
                    ranges.append(torch.arange(at, at + n, device=x.device))
                    counts.append(n)
                    break
                at += n
        pick = torch.cat(ranges)
        handle = GatheredReplicaHandle(x.shape[0], token[pick], weight[pick], max_count=max(counts), plan=plan)
        return x[handle.token_of_row], torch.tensor(counts, dtype=torch.int64, device=x.device), handle

    def combine(self, expert_out: torch.Tensor, handle: GatheredReplicaHandle) -> torch.Tensor:
        return reduce_scatter_tokens(weighted_sum(expert_out, handle), self.group)
