"""Balanced dispatch (``expert_balance = "replicate"``): hot experts' pairs computed by replicas.

:class:`ReplicatingDispatcher` is the all-to-all dispatcher with the :mod:`~par_moe.balance` plan:

1. Counts: each EP rank's kept pairs per expert ``[E]``, all-gathered (``[ep, E]``) and read once
   (the one host read per layer and micro-batch, as :meth:`AllToAllDispatcher.routed_sizes`). Every
   rank computes the same plan from them; every split size below follows from it, with no further
   exchange.
2. Dispatch: one row per kept (token, expert) pair, sent to the rank and slot the plan gives it
   (its expert's home slot, or a replica slot); the receiver sorts them by slot.
3. Weights: :func:`fetch_replicas` brings each replica slot its expert's weights from the home rank
   (an all-to-all of the replicated experts only). Backward: the replicas' weight gradients go home
   by the reverse all-to-all and are added to the home expert's, replica by replica in plan order.
4. Combine: each pair's output row goes back to its source, which weights it and sums a token's pairs.

One row per pair (not per token and rank as :class:`AllToAllDispatcher` sends): the rows each
rank sends to each other depend then on the counts alone, so the plan fixes every split size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from .balance import ReplicaPlan, plan_replicas
from .comm import _all_to_all, all_to_all_tokens, gather_no_grad, group_rank, group_size
from .declared import RoutedSizes
from .dispatch import sort_pairs


@dataclass
class ReplicaHandle:
    """What ``combine`` (and the weight fetch) need to undo a replicating dispatch."""

    plan: ReplicaPlan
    token_of_pair: torch.Tensor  # the source token of each sent row, in send order
    weight_of_pair: torch.Tensor  # its combine weight (differentiable)
    by_slot: torch.Tensor  # received rows in slot order: received[by_slot]
    input_splits: list[int]
    output_splits: list[int]
    num_source_tokens: int
    max_count: int  # the most rows of one slot on this rank (host-known from the plan)


def _runs(values: list[int], lengths: list[int], device: torch.device) -> torch.Tensor:
    """``values[i]`` repeated ``lengths[i]`` times (host-known lengths: no read)."""
    v = torch.tensor(values, dtype=torch.int64, device=device)
    return v.repeat_interleave(torch.tensor(lengths, dtype=torch.int64, device=device), output_size=sum(lengths))


class BalancedDispatcher:
    """What the balanced dispatchers (all-to-all here, all-gather in ``replicate_gather``) share: the EP
    group, the replica bound and the NVLink domains they plan with."""

    def __init__(self, num_experts: int, ep_group: ProcessGroup | None, max_replicas: int, across_domains: bool = False):
        self.group, self.ep, self.rank = ep_group, group_size(ep_group), group_rank(ep_group)
        self.num_experts, self.num_local, self.max_replicas = num_experts, num_experts // self.ep, max_replicas
        self.domains, self.across_domains = None, across_domains  # the EP ranks' NVLink domains (None: one)
        self.last_plan: ReplicaPlan | None = None  # the latest dispatch's plan (tests, logging)

    def plan_from(self, counts: list[list[int]]) -> ReplicaPlan:
        """The plan of every EP rank's pairs per expert (``counts[rank][expert]``), the same on every rank."""
        return plan_replicas(counts, self.num_local, self.max_replicas, self.domains, self.across_domains)


class ReplicatingDispatcher(BalancedDispatcher):
    """All-to-all dispatch over ``ep_group`` balanced by replicas (at most ``max_replicas`` per rank)."""

    def plan(self, indices: torch.Tensor, kept: torch.Tensor, declared: list[int] | None = None) -> ReplicaPlan:
        """Every rank's pairs per expert, gathered and read once; the plan from them (the same on every rank).
        ``declared``: this rank's pairs per expert of a declared routing (every rank alike): gathered, not read."""
        pairs = torch.zeros(self.num_experts, dtype=torch.int64, device=indices.device)
        pairs = pairs.scatter_add_(0, indices.reshape(-1), kept.reshape(-1).to(torch.int64))
        gathered = gather_no_grad(pairs.unsqueeze(0), self.group)  # [ep, E]
        counts = [declared] * self.ep if declared is not None else gathered.tolist()  # the one host read
        return self.plan_from(counts)

    def dispatch(self, x, indices, weights, keep=None, sizes: RoutedSizes | None = None):
        """Rows for this rank's slots sorted by slot, their counts per slot, the handle."""
        kept = torch.ones_like(indices, dtype=torch.bool) if keep is None else keep
        plan = self.last_plan = self.plan(indices, kept, None if sizes is None else sizes.pairs)
        me, width = self.rank, self.num_local + max(len(r) for r in plan.replicas)
        expert, token, weight = sort_pairs(indices, weights, keep, size=sum(plan.counts[me]))
        pieces = plan.pieces[me]  # this rank's pairs, in sort_pairs' order, cut by destination slot
        key = _runs([r * width + slot for r, slot, _ in pieces], [n for *_, n in pieces], x.device)
        order = torch.argsort(key, stable=True)  # by destination rank, then slot, then token
        token, weight = token[order], weight[order]
        input_splits = [plan.sent(me, d) for d in range(self.ep)]
        output_splits = [plan.sent(s, me) for s in range(self.ep)]
        received = all_to_all_tokens(x[token], self.group, output_splits, input_splits)
        runs = plan.received(me)
        by_slot = torch.argsort(_runs([s for s, _ in runs], [n for _, n in runs], x.device), stable=True)
        counts = plan.slot_counts(me)
        handle = ReplicaHandle(plan, token, weight, by_slot, input_splits, output_splits, x.shape[0], max(counts))
        return received[by_slot], torch.tensor(counts, dtype=torch.int64, device=x.device), handle

    def combine(self, expert_out: torch.Tensor, handle: ReplicaHandle) -> torch.Tensor:
        unsorted = torch.empty_like(handle.by_slot)
        unsorted[handle.by_slot] = torch.arange(handle.by_slot.numel(), device=unsorted.device)
        back = all_to_all_tokens(expert_out[unsorted], self.group, handle.input_splits, handle.output_splits)
        weighted = back * handle.weight_of_pair.to(back.dtype).unsqueeze(-1)
        return back.new_zeros(handle.num_source_tokens, back.shape[-1]).index_add(0, handle.token_of_pair, weighted)


class _FetchReplicas(torch.autograd.Function):
    """Forward: each home rank sends its replicated experts' weights to the replicas (all-to-all).
    Backward: the replicas' gradients return home (the reverse all-to-all); each home expert's is the
    sum of its replicas', added one replica at a time in send order (by destination rank): a fixed order."""

    @staticmethod
    def forward(ctx, w_gate, w_up, w_down, group, send, input_splits, output_splits):
        ctx.group, ctx.send, ctx.input_splits, ctx.output_splits = group, send, input_splits, output_splits
        ctx.shapes, ctx.kind = [w.shape for w in (w_gate, w_up, w_down)], dict(dtype=w_gate.dtype, device=w_gate.device)
        index = torch.tensor(send, dtype=torch.int64, device=w_gate.device)
        packed = torch.cat([w.index_select(0, index).flatten(1) for w in (w_gate, w_up, w_down)], dim=1)
        out = _all_to_all(packed, group, output_splits, input_splits)
        return tuple(part.reshape(-1, *shape[1:]) for part, shape in zip(_split3(out, ctx.shapes), ctx.shapes))

    @staticmethod
    def backward(ctx, *grads):
        rows = sum(ctx.output_splits)
        parts = [g if g is not None else torch.zeros(rows, *s[1:], **ctx.kind) for g, s in zip(grads, ctx.shapes)]
        back = _all_to_all(torch.cat([g.reshape(rows, s[1:].numel()) for g, s in zip(parts, ctx.shapes)], dim=1), ctx.group,
                           ctx.input_splits, ctx.output_splits)
        total = back.new_zeros(ctx.shapes[0][0], back.shape[1])
        seen: dict[int, int] = {}
        rounds: list[list[int]] = []  # round j: the j-th replica of each expert (no expert twice: a fixed sum)
        for position, expert in enumerate(ctx.send):
            j = seen[expert] = seen.get(expert, -1) + 1
            if j == len(rounds):
                rounds.append([])
            rounds[j].append(position)
        for positions in rounds:
            index = torch.tensor(positions, dtype=torch.int64, device=back.device)
            experts = torch.tensor([ctx.send[p] for p in positions], dtype=torch.int64, device=back.device)
            total.index_add_(0, experts, back.index_select(0, index))
        return (*(p.reshape(s) for p, s in zip(_split3(total, ctx.shapes), ctx.shapes)), None, None, None, None)


def _split3(packed: torch.Tensor, shapes) -> tuple[torch.Tensor, ...]:
    return packed.split([s[1:].numel() for s in shapes], dim=1)


def fetch_replicas(w_gate, w_up, w_down, plan: ReplicaPlan, group: ProcessGroup | None, rank: int):
    """This rank's replica weights ``(w_gate, w_up, w_down)``, each ``[replicas, ...]``, from their home
    ranks (autograd-aware, see :class:`_FetchReplicas`); None when the plan replicates nothing."""
    if not any(plan.replicas):
        return None
    first = rank * plan.num_local
    send = [(dest, e - first) for dest, experts in enumerate(plan.replicas) for e in experts
            if first <= e < first + plan.num_local]
    input_splits = [sum(d == dest for d, _ in send) for dest in range(plan.ep)]
    output_splits = [sum(e // plan.num_local == home for e in plan.replicas[rank]) for home in range(plan.ep)]
    return _FetchReplicas.apply(w_gate, w_up, w_down, group, [i for _, i in send], input_splits, output_splits)


def expert_bytes(w_gate, w_up, w_down) -> int:
    """Bytes of one local expert's weights (this rank's F shard): what one replica fetches and returns."""
    return sum(w[0].numel() * w.element_size() for w in (w_gate, w_up, w_down))


def balance_metrics(plan: ReplicaPlan, rank: int, one_expert_bytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The plan's figures as device scalars (read at log steps only): max / mean pairs per EP rank
    before and after balancing, their mean, replicas made, and the bytes EP rank ``rank``'s weight fetch sends
    (as many as its gradient return receives)."""
    figures = {"slots_max_over_mean_before": plan.max_over_mean(plan.load_before),
               "slots_max_over_mean_after": plan.max_over_mean(plan.load_after),
               "slots_per_rank": sum(plan.load_before) / plan.ep,
               "replicated_experts": float(sum(len(r) for r in plan.replicas)),
               "replica_fetch_bytes": float(plan.fetched(rank) * one_expert_bytes)}
    return {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in figures.items()}
