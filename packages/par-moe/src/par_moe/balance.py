"""The replica plan (``expert_balance = "replicate"``): which EP rank computes which (token, expert) pairs.

A pure function of the global counts: ``counts[s][e]`` is how many pairs EP rank ``s`` routes to
expert ``e``. Every EP rank gathers the same counts (one small all-gather, read once) and so computes
the same plan, with no further exchange. Expert ``e`` lives on its home rank ``e // L`` (``L``
experts per rank). Today a rank computes every pair of its experts; with the plan, a rank whose
pairs exceed ``cap = ceil(total / ep)`` keeps ``cap`` and sends the rest of its hottest experts' pairs
to replica slots on ranks below ``cap`` (each receiving at most ``max_replicas`` replicas), which
then compute those pairs with the home expert's weights. So every rank computes at most ``cap``
pairs, unless the replica bound stops it (then the rest stays home). Given the EP ranks' NVLink
domains, replicas stay in their home rank's domain, each domain balanced to its own ``cap``, unless
``across_domains`` allows the rest to cross (after the home domain's ranks).

An expert's pairs are ordered by source rank, then as the source sorted them (by token); the home
rank takes the first of them and its replicas the next, in plan order (:attr:`ReplicaPlan.segments`).
Replica slot ``L + i`` of a rank holds its ``i``-th replicated expert in expert order (so by home rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class ReplicaPlan:
    counts: tuple[tuple[int, ...], ...]  # [ep][E]: pairs each source rank routes to each expert
    num_local: int  # L: home experts per rank
    segments: tuple[tuple[tuple[int, int], ...], ...]  # per expert: (rank, pairs) in order, the home rank first

    @property
    def ep(self) -> int:
        return len(self.counts)

    @property
    def num_experts(self) -> int:
        return len(self.counts[0])

    @cached_property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the experts of its replica slots ``L, L + 1, ...`` (ascending)."""
        out: list[list[int]] = [[] for _ in range(self.ep)]
        for e, segs in enumerate(self.segments):
            for rank, _ in segs[1:]:
                out[rank].append(e)
        return tuple(tuple(r) for r in out)

    def slot_of(self, rank: int, expert: int) -> int:
        """The slot of ``rank`` that computes ``expert``: its local index at home, else its replica slot."""
        if expert // self.num_local == rank:
            return expert - rank * self.num_local
        return self.num_local + self.replicas[rank].index(expert)

    def num_slots(self, rank: int) -> int:
        return self.num_local + len(self.replicas[rank])

    @cached_property
    def pieces(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per source rank, its pairs in its order (by expert, then token) cut into ``(dest rank, dest slot, n)``."""
        out = []
        start = [0] * self.num_experts  # where each source's range starts in an expert's pair order
        for s in range(self.ep):
            mine = []
            for e, segs in enumerate(self.segments):
                first, end = start[e], start[e] + self.counts[s][e]
                start[e] = end
                at = 0
                for rank, n in segs:
                    take = min(end, at + n) - max(first, at)
                    if take > 0:
                        mine.append((rank, self.slot_of(rank, e), take))
                    at += n
            out.append(tuple(mine))
        return tuple(out)

    def sent(self, source: int, dest: int) -> int:
        """Pairs (rows) ``source`` sends to ``dest``."""
        return sum(n for r, _, n in self.pieces[source] if r == dest)

    def received(self, dest: int) -> tuple[tuple[int, int], ...]:
        """The ``(slot, n)`` runs ``dest`` receives, by source rank, each source's runs by slot."""
        return tuple((slot, n) for s in range(self.ep)
                     for slot, n in sorted((slot, n) for r, slot, n in self.pieces[s] if r == dest))

    def slot_counts(self, rank: int) -> list[int]:
        """Pairs ``rank`` computes in each of its slots."""
        out = [0] * self.num_slots(rank)
        for slot, n in self.received(rank):
            out[slot] += n
        return out

    @cached_property
    def load_before(self) -> tuple[int, ...]:
        """Pairs each rank computes without replicas: all of its home experts'."""
        per_expert = [sum(col) for col in zip(*self.counts)]
        return tuple(sum(per_expert[r * self.num_local:(r + 1) * self.num_local]) for r in range(self.ep))

    @cached_property
    def load_after(self) -> tuple[int, ...]:
        out = [0] * self.ep
        for segs in self.segments:
            for rank, n in segs:
                out[rank] += n
        return tuple(out)

    def max_over_mean(self, load: tuple[int, ...]) -> float:
        """The most pairs on one rank over the mean (1.0 for no pairs)."""
        total = sum(load)
        return max(load) * len(load) / total if total else 1.0

    def fetched(self, home: int) -> int:
        """Expert weight sets ``home`` sends to its replicas (and whose gradients come back)."""
        return sum(len(segs) - 1 for segs in self.segments[home * self.num_local:(home + 1) * self.num_local])


def plan_replicas(counts, num_local: int, max_replicas: int, domains=None, across_domains: bool = False) -> ReplicaPlan:
    """The plan for ``counts [ep][E]`` (nested sequences of ints), at most ``max_replicas`` replicas per rank.

    A donor (a rank over ``cap``) gives its excess; each receiver (a rank under ``cap``, the largest
    gap first, ties: the lower rank) takes it up to ``cap``, one replica at a time: while it has a
    replica to spare, the smallest chunk that another donor's chunk can then top up in one cut,
    taken whole (so small leftovers do not pile up); else the smallest chunk that fills it, cut;
    else the largest chunk. A donor's chunk of expert ``e`` is what it may still shed through
    ``e``: ``min(its excess, e's pairs left home)``; ties go to the lower expert.

    ``domains`` (per EP rank, its NVLink domain; None: one domain): replicas stay in their home rank's
    domain. Without ``across_domains`` each domain balances alone, to ``cap = ceil(its pairs / its
    ranks)`` (max / mean over a domain's ranks <= 1 + 1 / its mean, replica bound permitting); with it,
    to the global ``cap``, the home domain's ranks first, then any rank still under ``cap``.
    """
    counts = tuple(tuple(int(n) for n in row) for row in counts)
    ep, experts = len(counts), len(counts[0])
    if experts != ep * num_local or any(len(row) != experts for row in counts):
        raise ValueError(f"counts must be [ep={ep}][{ep} x {num_local} experts], got rows of {[len(r) for r in counts]}")
    domains = tuple(domains) if domains is not None else (0,) * ep
    if len(domains) != ep:
        raise ValueError(f"domains={list(domains)} must name one NVLink domain per EP rank ({ep})")
    per_expert = [sum(col) for col in zip(*counts)]
    load = [sum(per_expert[r * num_local:(r + 1) * num_local]) for r in range(ep)]
    if across_domains:
        cap = [math.ceil(sum(load) / ep)] * ep
    else:  # each domain's own
        cap = [math.ceil(sum(n for n, d in zip(load, domains) if d == mine) / domains.count(mine)) for mine in domains]
    home = list(per_expert)  # pairs left at home
    moved: list[list[tuple[int, int]]] = [[] for _ in range(experts)]
    used = [0] * ep  # replicas per rank

    def chunks(donors):  # (pairs expert e's donor may still shed through e, e), largest first, ties: the lower e
        out = [(min(load[e // num_local] - cap[e // num_local], home[e]), e) for e in range(experts)
               if e // num_local in donors]
        return sorted(((n, e) for n, e in out if n > 0), key=lambda c: (-c[0], c[1]))

    def move(e: int, r: int, n: int) -> None:
        moved[e].append((r, n))
        used[r] += 1
        load[r] += n
        load[e // num_local] -= n
        home[e] -= n

    def fill(same_domain: bool) -> None:
        for r in sorted((r for r in range(ep) if load[r] < cap[r]), key=lambda r: (load[r] - cap[r], r)):
            donors = {d for d in range(ep) if domains[d] == domains[r] or not same_domain}
            while used[r] < max_replicas:
                room, available = cap[r] - load[r], chunks(donors)
                if room <= 0 or not available:
                    break
                whole = None  # a small chunk taken whole, if another donor's chunk can then fill the rest in one cut
                if used[r] < max_replicas - 1:
                    for n, e in reversed(available):
                        if n < room and any(m >= room - n and f // num_local != e // num_local for m, f in available):
                            whole = (n, e)
                            break
                if whole is None:
                    fits = [c for c in available if c[0] >= room]
                    whole = (room, fits[-1][1]) if fits else available[0]
                move(whole[1], r, whole[0])

    fill(same_domain=True)
    if across_domains and len(set(domains)) > 1:  # what the domains could not take
        fill(same_domain=False)
    segments = tuple(((e // num_local, home[e]),) + tuple(moved[e]) for e in range(experts))
    return ReplicaPlan(counts, num_local, segments)
