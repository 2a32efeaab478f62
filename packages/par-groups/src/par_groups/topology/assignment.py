"""Rank assignment: which physical rank plays each grid position, so hungry groups stay on NVLink.

A rank assignment is an order string plus a ``permutation`` with ``permutation[i]`` = the
global rank that plays grid position ``i``, exactly what ``create_groups(grid, permutation=...)``
takes. :func:`place` tries every valid order string, each with the identity permutation and
with the ranks re-sorted by NVLink domain then node (the explicit permutation needed when the
launcher did not number ranks node by node). It keeps the candidate with the fewest of tp, ep,
expert tp and the CP all-to-all level off NVLink, then the cheapest under the cost model of
:mod:`.cost`. Ties keep the user's order, then the identity permutation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from ..grid import DIMENSIONS, LayoutError, RankGrid
from .cost import Workload, bytes_per_step, exposed_share
from .model import Topology, check_world

# Groups whose traffic is on the critical path and heavy: they belong inside one NVLink domain.
HUNGRY = ("tp", "ep", "etp")
# Bulk gradient reductions, which NCCL spreads over every NIC of a node; the small, latency-bound
# messages of the hungry groups get one NIC's bandwidth.
MULTI_RAIL = ("dp", "dp_cp", "edp")


@dataclass(frozen=True)
class GroupCost:
    """One group type under an assignment: physical rank lists and the slowest link they cross."""

    ranks: tuple[tuple[int, ...], ...]
    link: str
    gbps: float
    bytes_per_step: float  # per rank; 0 for types the cost model does not charge (e.g. cp under hcp)
    seconds: float  # exposed time per step: bytes / bandwidth x exposed share

    @property
    def size(self) -> int:
        return len(self.ranks[0])


@dataclass(frozen=True)
class RankAssignment:
    topology: Topology
    grid: RankGrid  # with the chosen order
    permutation: tuple[int, ...]  # permutation[i] = global rank of grid position i
    groups: dict[str, GroupCost]
    workload: Workload
    warnings: tuple[str, ...] = ()
    candidates: int = 1
    given: "RankAssignment | None" = field(default=None, repr=False)  # the layout as the user gave it

    @property
    def order(self) -> str:
        return self.grid.order

    @property
    def is_identity(self) -> bool:
        return list(self.permutation) == list(range(len(self.permutation)))

    @property
    def cost_s(self) -> float:
        return sum(g.seconds for g in self.groups.values())

    def to_dict(self) -> dict:
        out = {
            "topology": self.topology.describe(),
            "order": self.order,
            "permutation": list(self.permutation),
            "identity": self.is_identity,
            "groups": {n: {"size": g.size, "count": len(g.ranks), "ranks": [list(r) for r in g.ranks],
                           "link": g.link, "gbps": g.gbps, "bytes_per_step": g.bytes_per_step,
                           "seconds": g.seconds} for n, g in self.groups.items()},
            "cost_s": self.cost_s,
            "candidates": self.candidates,
            "warnings": list(self.warnings),
        }
        if self.given is not None:
            out["given"] = {"order": self.given.order, "cost_s": self.given.cost_s}
        return out


def logical_groups(grid: RankGrid, work: Workload) -> dict[str, list[list[int]]]:
    """Grid-position rank lists of every group type larger than one rank."""
    out = {
        "tp": grid.ranks("tp"), "cp": grid.ranks("cp"), "ep": grid.expert_ranks("ep"),
        "etp": grid.expert_ranks("tp"), "dp": grid.ranks("dp"), "dp_cp": grid.ranks("dp-cp"),
        "edp": grid.expert_ranks("dp"), "pp": grid.ranks("pp"),
    }
    if grid.cp == 1:
        del out["dp_cp"]  # same as dp
    if grid.ep == 1 and grid.etp == grid.tp:
        for name in ("ep", "etp", "edp"):  # a dense model: the expert view repeats tp and dp
            del out[name]
    for level, groups in enumerate(grid.hcp_ranks()):
        out[f"hcp{level}"] = groups
    return {n: g for n, g in out.items() if len(g[0]) > 1}


def a2a_level(grid: RankGrid, work: Workload) -> str | None:
    """The CP group type doing all-to-all (Ulysses), if any."""
    if grid.hcp:
        return "hcp0" if grid.hcp[0] > 1 else None
    return "cp" if grid.cp > 1 and work.cp_comm == "a2a" else None


def evaluate(grid: RankGrid, topology: Topology, permutation=None, workload: Workload | None = None) -> RankAssignment:
    """Links, bytes and time of every group type of ``grid`` with ranks assigned by ``permutation`` (identity if None)."""
    work = workload or Workload()
    check_world(topology, grid.world_size)
    perm = tuple(range(grid.world_size)) if permutation is None else tuple(int(r) for r in permutation)
    if sorted(perm) != list(range(grid.world_size)):
        raise LayoutError(f"permutation must be a permutation of 0..{grid.world_size - 1}")
    volume = bytes_per_step(grid, work)
    groups = {}
    for name, logical in logical_groups(grid, work).items():
        physical = tuple(tuple(perm[r] for r in g) for g in logical)
        link = max((topology.group_link(g) for g in physical), key=_slowness)
        gbps = min(topology.group_gbps(g, multi_rail=name in MULTI_RAIL) for g in physical)
        nbytes = volume.get(name, 0.0)
        seconds = nbytes / (gbps * 1e9) * exposed_share(name, grid, work) if nbytes else 0.0
        groups[name] = GroupCost(ranks=physical, link=link, gbps=gbps, bytes_per_step=nbytes, seconds=seconds)
    result = RankAssignment(topology=topology, grid=grid, permutation=perm, groups=groups, workload=work)
    return replace(result, warnings=tuple(warnings_for(result)))


def _slowness(link: str) -> int:
    return ("nvlink", "pcie", "network").index(link)


def candidate_orders(grid: RankGrid) -> list[RankGrid]:
    """The grid under every valid order string with distinct groups; the given order first.

    Two orders give the same groups when they list the dimensions larger than one in the same
    order in both the dense and the expert view, so duplicates are dropped before any rank list
    is computed.
    """
    dense = {"tp": grid.tp, "cp": grid.cp, "ep": 1, "dp": grid.dp, "pp": grid.pp}
    expert = {"tp": grid.etp, "cp": 1, "ep": grid.ep, "dp": grid.edp, "pp": grid.pp}
    orders = [grid.order, "tp-cp-ep-dp-pp"] + ["-".join(p) for p in itertools.permutations(DIMENSIONS)]
    seen, out = set(), []
    for order in orders:
        tokens = order.split("-")
        tokens += [t for t in DIMENSIONS if t not in tokens]
        signature = (tuple(t for t in tokens if dense[t] > 1), tuple(t for t in tokens if expert[t] > 1))
        if signature in seen:
            continue
        seen.add(signature)
        try:
            out.append(RankGrid(grid.world_size, tp=grid.tp, cp=grid.cp, pp=grid.pp, ep=grid.ep, etp=grid.etp,
                                order=order, hcp=grid.hcp))
        except LayoutError:
            continue
    return out


def candidate_permutations(topology: Topology) -> list[tuple[int, ...]]:
    """Identity, then ranks sorted by NVLink domain then node, then by node: consecutive grid
    positions land on one domain / node even if the launcher interleaved the hosts."""
    n = topology.world_size

    def first_seen(keys):
        order: dict = {}
        return [order.setdefault(k, len(order)) for k in keys]

    gpus = topology.gpus
    domain = first_seen(g.domain if g.domain is not None else ("node", g.node) for g in gpus)
    node = first_seen(g.node for g in gpus)
    by_domain = tuple(sorted(range(n), key=lambda r: (domain[r], node[r], gpus[r].local, r)))
    by_node = tuple(sorted(range(n), key=lambda r: (node[r], gpus[r].local, r)))
    out = []
    for p in (tuple(range(n)), by_domain, by_node):
        if p not in out:
            out.append(p)
    return out


def assign_ranks(grid: RankGrid, topology: Topology, workload: Workload | None = None) -> RankAssignment:
    """The cheapest order string (and permutation) for ``grid``'s sizes on ``topology``."""
    work = workload or Workload()
    given = evaluate(grid, topology, None, work)
    best, count = given, 0
    for g in candidate_orders(grid):
        for perm in candidate_permutations(topology):
            count += 1
            c = evaluate(g, topology, perm, work)
            if _better(c, best):
                best = c
    return replace(best, candidates=count, given=given)


def hungry_off_fast_links(p: RankAssignment) -> int:
    """How many NVLink-hungry group types (tp, ep, etp, CP all-to-all) leave the fastest link class."""
    fast = "nvlink" if p.topology.domain_ranks() else "pcie"
    names = [n for n in HUNGRY if n in p.groups] + [a for a in [a2a_level(p.grid, p.workload)] if a in p.groups]
    return sum(_slowness(p.groups[n].link) > _slowness(fast) for n in names)


def _better(c: RankAssignment, best: RankAssignment) -> bool:
    """Keeping the hungry groups on NVLink comes first (the rule), the cost model ranks the rest;
    a cost must be clearly lower to win, so float noise keeps the earlier candidate."""
    a, b = hungry_off_fast_links(c), hungry_off_fast_links(best)
    return a < b or (a == b and c.cost_s < best.cost_s * (1 - 1e-6))


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def warnings_for(p: RankAssignment) -> list[str]:
    """Say which bandwidth-hungry group crosses a slow link, why, and what would fix it."""
    topo, grid, work = p.topology, p.grid, p.workload
    has_nvlink = bool(topo.domain_ranks())
    fast = "nvlink" if has_nvlink else "pcie"
    span = topo.largest_domain() if has_nvlink else max(len(n) for n in topo.node_ranks())
    where = f"an NVLink domain of {span} GPUs" if has_nvlink else f"a node of {span} GPUs (no NVLink)"
    hungry = [n for n in HUNGRY if n in p.groups]
    a2a = a2a_level(grid, work)
    if a2a and a2a in p.groups:
        hungry.append(a2a)
    out = []
    for name in hungry:
        g = p.groups[name]
        if _slowness(g.link) <= _slowness(fast):
            continue
        head = (f"{_label(name, grid)} groups of {g.size} ranks cross {g.link} "
                f"({topo.bandwidth[g.link]:g} GB/s per link instead of {fast} {topo.bandwidth[fast]:g} GB/s)")
        if g.size > span:
            out.append(f"{head}: {g.size} ranks do not fit in {where}. Fix: {_fix(name, grid, span)}")
            continue
        dense_block = grid.tp * (p.groups[a2a].size if a2a in p.groups else 1)
        expert_block = grid.etp * grid.ep
        if max(dense_block, expert_block) > span:
            out.append(f"{head}: it fits in {where} alone, but tp x CP all-to-all = {dense_block} or "
                       f"expert tp x ep = {expert_block} ranks do not, so not all of them can. "
                       f"Fix: keep both products <= {span}, e.g. {_fix(a2a or 'tp', grid, span)}")
        else:
            out.append(f"{head}: the grid does not line up with {where}. Fix: choose group sizes that divide "
                       f"{span}, or launch ranks so that they fill one {'domain' if has_nvlink else 'node'} after another")
    return out


def _label(name: str, grid: RankGrid) -> str:
    return {"hcp0": "hierarchical CP all-to-all (hcp0)", "cp": "CP all-to-all", "etp": "expert TP"}.get(name, name)


def _fix(name: str, grid: RankGrid, span: int) -> str:
    if name == "tp":
        d = _largest_divisor_at_most(grid.tp, span)
        return f"--tp {d} and move the remaining factor {grid.tp // d} to --pp or --cp (e.g. --tp {d} --pp {grid.pp * grid.tp // d})"
    if name == "ep":
        d = _largest_divisor_at_most(grid.ep, max(1, span // grid.etp))
        return f"--ep {d} (with --etp {grid.etp}); the remaining factor {grid.ep // d} becomes expert data parallelism"
    if name == "etp":
        d = _largest_divisor_at_most(grid.etp, max(1, span // grid.ep))
        return f"--etp {d}"
    inner = _largest_divisor_at_most(grid.cp, max(1, span // grid.tp))
    if inner > 1:
        return f"hierarchical CP with the all-to-all level inside the domain: --hcp {inner},{grid.cp // inner}"
    return f"a smaller --tp so that tp x (all-to-all size) fits {span} GPUs, or a ring (p2p) CP"
