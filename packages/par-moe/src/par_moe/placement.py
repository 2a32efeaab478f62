"""Expert placement (``expert_balance = "replicate+replace"``): which EP rank and local slot hold each expert.

Without re-placement EP rank ``r`` holds experts ``[r L, (r + 1) L)`` (``L = E / ep``). An
:class:`ExpertPlacement` generalises that to any permutation: position ``r L + i`` (rank ``r``,
slot ``i``) holds expert ``expert_at[r L + i]``. The dispatchers route by position (the layer maps
each routed expert to its position first), so nothing downstream knows about the permutation; the
expert parameters' placement names the global expert of each local slot (checkpoints stay keyed by
the global expert index).

:func:`pack_experts` is the re-placement: a pure function of the load per expert and the current
placement, so every rank computes the same map from the same (all-reduced) counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class ExpertPlacement:
    expert_at: tuple[int, ...]  # per position (rank * num_local + slot): the global expert held there
    num_local: int  # L: slots per EP rank

    def __post_init__(self) -> None:
        if sorted(self.expert_at) != list(range(len(self.expert_at))) or len(self.expert_at) % self.num_local:
            raise ValueError(f"expert_at={list(self.expert_at)} must be a permutation of 0..E-1 with E a multiple "
                             f"of num_local={self.num_local}")

    @classmethod
    def contiguous(cls, num_experts: int, ep: int) -> "ExpertPlacement":
        """Rank ``r`` holds experts ``[r L, (r + 1) L)``: the placement without re-placement."""
        return cls(tuple(range(num_experts)), num_experts // ep)

    @property
    def ep(self) -> int:
        return len(self.expert_at) // self.num_local

    @cached_property
    def position_of(self) -> tuple[int, ...]:
        """Per global expert, its position (the inverse permutation)."""
        out = [0] * len(self.expert_at)
        for position, expert in enumerate(self.expert_at):
            out[expert] = position
        return tuple(out)

    def slots(self, rank: int) -> tuple[int, ...]:
        """The experts of ``rank``'s slots ``0 .. L-1``."""
        return self.expert_at[rank * self.num_local:(rank + 1) * self.num_local]

    def is_contiguous(self) -> bool:
        return self.expert_at == tuple(range(len(self.expert_at)))

    def moves_to(self, new: "ExpertPlacement") -> list[tuple[int, int, int, int, int]]:
        """``(expert, from rank, from slot, to rank, to slot)`` of every expert whose position changes,
        by destination position (the order both ends of a move derive alike)."""
        out = []
        for position, expert in enumerate(new.expert_at):
            old = self.position_of[expert]
            if old != position:
                out.append((expert, *divmod(old, self.num_local), *divmod(position, new.num_local)))
        return out


def pack_experts(load, current: ExpertPlacement, domains: tuple[int, ...] | None = None) -> ExpertPlacement:
    """Greedy packing of experts by ``load`` (pairs per global expert) onto ``current.ep`` ranks of
    ``current.num_local`` slots each: experts by decreasing load (ties: the lower expert), each onto the
    least loaded rank with a free slot (ties: the rank holding it now, so fewer move; then the lower
    rank). An expert staying on its rank keeps its slot; the others fill the freed slots in expert order.
    Deterministic: the same counts give the same map on every rank.

    ``domains`` (per EP rank, its NVLink domain): experts first stay in their domain, and cross to
    another only by swaps that lower the most loaded domain's load per rank (the best swap first, until
    none does); then each domain packs its own experts onto its ranks as above."""
    load = [int(n) for n in load]
    ep, per_rank = current.ep, current.num_local
    if len(load) != len(current.expert_at):
        raise ValueError(f"load has {len(load)} experts, the placement {len(current.expert_at)}")
    domains = tuple(domains) if domains is not None else (0,) * ep
    if len(domains) != ep:
        raise ValueError(f"domains={list(domains)} must name one NVLink domain per EP rank ({ep})")
    members = {d: [e for e in range(len(load)) if domains[current.position_of[e] // per_rank] == d]
               for d in sorted(set(domains))}
    _swap_across_domains(load, members, {d: domains.count(d) for d in members})
    expert_at = [-1] * len(load)
    for d, experts in members.items():
        _pack_ranks(load, current, experts, [r for r in range(ep) if domains[r] == d], expert_at)
    return ExpertPlacement(tuple(expert_at), per_rank)


def _swap_across_domains(load: list[int], members: dict[int, list[int]], ranks: dict[int, int]) -> None:
    """Swap experts between the most loaded domain (load per rank) and another while that lowers the
    higher of the two; in place."""
    for _ in range(len(load) ** 2):  # a bound: each swap lowers the pair's larger load, few are needed
        per_rank = {d: sum(load[e] for e in m) / ranks[d] for d, m in members.items()}
        top = max(members, key=lambda d: (per_rank[d], -d))
        best = None
        for d in members:
            for a in members[top]:
                for b in members[d]:
                    moved = load[a] - load[b]
                    worse = max(per_rank[top] - moved / ranks[top], per_rank[d] + moved / ranks[d])
                    if d != top and moved > 0 and worse < per_rank[top] and (best is None or worse < best[0]):
                        best = (worse, a, b, d)
        if best is None:
            return
        _, a, b, d = best
        members[top][members[top].index(a)], members[d][members[d].index(b)] = b, a


def _pack_ranks(load: list[int], current: ExpertPlacement, experts: list[int], ranks: list[int], expert_at: list[int]):
    """LPT of ``experts`` onto ``ranks`` (as many slots as experts), into ``expert_at``."""
    per_rank = current.num_local
    rank_load, held = {r: 0 for r in ranks}, {r: [] for r in ranks}
    for expert in sorted(experts, key=lambda e: (-load[e], e)):
        home = current.position_of[expert] // per_rank
        free = [r for r in ranks if len(held[r]) < per_rank]
        rank = min(free, key=lambda r: (rank_load[r], r != home, r))
        held[rank].append(expert)
        rank_load[rank] += load[expert]
    for rank in ranks:
        arriving = []
        for expert in sorted(held[rank]):
            position = current.position_of[expert]
            if position // per_rank == rank:
                expert_at[position] = expert  # stays in its slot
            else:
                arriving.append(expert)
        free_slots = [rank * per_rank + i for i in range(per_rank) if expert_at[rank * per_rank + i] < 0]
        for position, expert in zip(free_slots, arriving):
            expert_at[position] = expert
