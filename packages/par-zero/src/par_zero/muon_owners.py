"""Which rank of a sharding group orthogonalizes which Muon matrix: Newton-Schulz FLOPs balanced.

A *unit* is one whole matrix: a 2-D Muon param, or one expert's matrix of an ``[E, F, H]`` tensor.
Per sharding group (the buckets sharing ``groups.inner``: dense, expert), every unit of every bucket
gets ONE owner by the greedy "largest first onto the least-loaded rank" (LPT; at most 4/3 of the
optimum, and close to even when units are many or equal). It depends only on the buckets' params and
full shapes, so every rank of the group computes the same assignment at construction, with no
communication; so do the ranks of a TP group, which hold the same params' blocks (checked in muon.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from par_groups.param_placement import placement_of

from .bucket import Bucket
from .newton_schulz import ns_flops


def assign_owners(costs: list[int], ranks: int) -> tuple[list[int], list[int]]:
    """(owner of each unit, total cost per rank): largest cost first onto the least-loaded rank,
    ties to the earlier unit and the lower rank (deterministic)."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: an owner assignment needs at least 1 rank")
    owners, heap = [0] * len(costs), [(0, r) for r in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    loads = [0] * ranks
    for load, r in heap:
        loads[r] = load
    return owners, loads


def expert_count(p: nn.Parameter) -> int:
    """How many matrices ``p`` holds (its leading dims: this rank's experts; 1 for a 2-D param)."""
    n = 1
    for s in p.shape[:-2]:
        n *= s
    return n


@dataclass
class Owners:
    """One sharding group's assignment. ``owned[bucket]``: (param, its expert indices) this rank
    orthogonalizes, in bucket order; ``loads``: Newton-Schulz FLOPs per rank of the group."""

    loads: list[int]
    owned: dict[Bucket, list[tuple[nn.Parameter, list[int]]]] = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        """max / mean FLOPs per rank (1.0: even)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0


def assign_buckets(buckets: list[Bucket], matrices: dict[Bucket, list[nn.Parameter]], ns_steps: int) -> list[Owners]:
    """The owner assignment of each sharding group of ``buckets`` (``matrices``: each bucket's Muon params)."""
    families: dict = {}  # groups.inner -> its buckets, in order (a ProcessGroup hashes by identity)
    for b in buckets:
        families.setdefault(b.groups.inner, []).append(b)
    out = []
    for group, family in families.items():
        units = [(b, p, e) for b in family for p in matrices[b] for e in range(expert_count(p))]
        owners, loads = assign_owners([ns_flops(placement_of(p).full_shape, ns_steps) for _, p, _ in units],
                                      dist.get_world_size(group))
        me, assignment = dist.get_rank(group), Owners(loads)
        for b in family:
            assignment.owned[b] = []
        for (b, p, e), r in zip(units, owners):
            if r != me:
                continue
            mine = assignment.owned[b]
            if mine and mine[-1][0] is p:
                mine[-1][1].append(e)  # a rank's experts of one tensor: batched
            else:
                mine.append((p, [e]))
        out.append(assignment)
    return out
