"""The topology model: nodes, GPUs, NVLink domains and link classes, independent of NVML.

A :class:`Topology` lists one GPU per global rank (``gpus[r]`` is the GPU rank ``r`` runs on).
Two GPUs talk over one of three link classes, from fastest to slowest:

* ``nvlink``  - both GPUs are in one NVLink domain (an NVSwitch node, bridged pair, or a
  multi-node NVLink fabric such as NVL72, where a domain spans several hosts),
* ``pcie``    - same node, different (or no) NVLink domain: through PCIe / the CPU,
* ``network`` - different nodes, different domains: through the NICs (InfiniBand / RoCE).

Bandwidths are GB/s per GPU in one direction, the rate a ring collective sees per rank.
A path that crosses the network also crosses PCIe, so the classes are ordered, not only ranked
by bandwidth: "the slowest link of a group" is the latest class in :data:`LINK_CLASSES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

LINK_CLASSES = ("nvlink", "pcie", "network")


class TopologyError(ValueError):
    """A topology description that cannot be used; the message names the values and valid ones."""


@dataclass(frozen=True)
class Gpu:
    """One GPU: where it sits (node, local index) and which NVLink domain it belongs to (or None)."""

    node: int
    local: int
    domain: int | None = None
    name: str = "GPU"
    memory_gb: float = 0.0
    uuid: str = ""
    pci_bus: str = ""
    numa: int | None = None
    nvlinks: int = 0  # active NVLink links, for the summary ("NV18")


@dataclass(frozen=True)
class Topology:
    """GPUs in global-rank order, the hosts they sit on, and the bandwidth of each link class.

    ``labels`` optionally refines the pcie class for display, keyed by a pair of global ranks
    (nvidia-smi's PIX / PXB / PHB / NODE / SYS); placement only uses :meth:`link`.
    """

    name: str
    nodes: tuple[str, ...]
    gpus: tuple[Gpu, ...]
    bandwidth: Mapping[str, float]
    source: str = "described"  # described | preset | nvml | fallback
    notes: tuple[str, ...] = ()
    labels: Mapping[tuple[int, int], str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "gpus", tuple(self.gpus))
        object.__setattr__(self, "notes", tuple(self.notes))
        if not self.gpus:
            raise TopologyError(f"topology {self.name!r} has no GPUs")
        needed = LINK_CLASSES if any(g.domain is not None for g in self.gpus) else LINK_CLASSES[1:]
        missing = [c for c in needed if c not in self.bandwidth]
        bad = {c: b for c, b in self.bandwidth.items() if c in LINK_CLASSES and not b > 0}
        if missing or bad:
            raise TopologyError(
                f"topology {self.name!r} needs a positive bandwidth (GB/s) for each of {', '.join(needed)}; "
                f"missing {missing}, not positive {bad}"
            )
        for r, g in enumerate(self.gpus):
            if not 0 <= g.node < len(self.nodes):
                raise TopologyError(f"gpu of rank {r} is on node {g.node}, but there are {len(self.nodes)} nodes")

    @property
    def world_size(self) -> int:
        return len(self.gpus)

    def link(self, a: int, b: int) -> str:
        """The link class between the GPUs of global ranks ``a`` and ``b``."""
        ga, gb = self.gpus[a], self.gpus[b]
        if ga.domain is not None and ga.domain == gb.domain:
            return "nvlink"
        return "pcie" if ga.node == gb.node else "network"

    def group_link(self, ranks: Sequence[int]) -> str | None:
        """The slowest link class any two members cross; None for a group of one."""
        if len(ranks) < 2:
            return None
        nodes = {self.gpus[r].node for r in ranks}
        domains = {self.gpus[r].domain for r in ranks}
        if len(domains) == 1 and None not in domains:
            return "nvlink"
        return "pcie" if len(nodes) == 1 else "network"

    def group_gbps(self, ranks: Sequence[int], multi_rail: bool = False) -> float:
        """Bandwidth per rank of a collective over ``ranks``: that of its slowest link class.

        With ``multi_rail`` (large gradient reductions), a group crossing the network with k
        members on every node drives k NICs at once (one per GPU, as NCCL's hierarchical
        algorithms do), capped by the links inside each node.
        """
        link = self.group_link(ranks)
        if link is None:
            return float("inf")
        if link != "network" or not multi_rail:
            return self.bandwidth[link]
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.gpus[r].node, []).append(r)
        rails = min(len(m) for m in by_node.values())
        inside = [self.group_link(m) for m in by_node.values() if len(m) > 1]
        cap = min((self.bandwidth[c] for c in inside if c), default=float("inf"))
        return min(self.bandwidth["network"] * rails, cap)

    def node_ranks(self) -> list[list[int]]:
        """Global ranks on each node, in node order."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for r, g in enumerate(self.gpus):
            out[g.node].append(r)
        return out

    def domain_ranks(self) -> list[list[int]]:
        """Global ranks of each NVLink domain, in order of first appearance."""
        out: dict[int, list[int]] = {}
        for r, g in enumerate(self.gpus):
            if g.domain is not None:
                out.setdefault(g.domain, []).append(r)
        return list(out.values())

    def largest_domain(self) -> int:
        """GPUs in the biggest NVLink domain (1 when there is no NVLink)."""
        return max((len(d) for d in self.domain_ranks()), default=1)

    def label(self, a: int, b: int) -> str:
        """nvidia-smi style label of the path between two GPUs: X, NV<links>, PIX.../PCIe, NET."""
        if a == b:
            return "X"
        kind = self.link(a, b)
        if kind == "nvlink":
            n = min(self.gpus[a].nvlinks, self.gpus[b].nvlinks)
            return f"NV{n}" if n else "NV"
        if kind == "network":
            return "NET"
        return self.labels.get((a, b)) or self.labels.get((b, a)) or "PCIe"

    def describe(self) -> str:
        """One line: name, nodes x GPUs, NVLink domains, bandwidths."""
        per_node = sorted({len(n) for n in self.node_ranks()})
        domains = self.domain_ranks()
        dom = "no NVLink" if not domains else f"{len(domains)} NVLink domain(s) of {sorted({len(d) for d in domains})} GPUs"
        bw = ", ".join(f"{c} {self.bandwidth[c]:g} GB/s" for c in LINK_CLASSES if c in self.bandwidth)
        per = per_node[0] if len(per_node) == 1 else per_node
        return f"{self.name}: {len(self.nodes)} node(s) x {per} GPUs = {self.world_size} GPUs, {dom}; {bw}"

    def to_dict(self) -> dict:
        """A JSON/TOML-able description (the explicit ``[[gpus]]`` form :func:`from_dict` reads)."""
        gpus = []
        for g in self.gpus:
            d = {"node": g.node, "local": g.local, "name": g.name, "memory_gb": g.memory_gb}
            if g.domain is not None:
                d["domain"] = g.domain
            if g.uuid:
                d["uuid"] = g.uuid
            if g.pci_bus:
                d["pci_bus"] = g.pci_bus
            if g.numa is not None:
                d["numa"] = g.numa
            if g.nvlinks:
                d["nvlinks"] = g.nvlinks
            gpus.append(d)
        return {"name": self.name, "source": self.source, "hosts": list(self.nodes),
                "bandwidth": {c: self.bandwidth[c] for c in LINK_CLASSES if c in self.bandwidth}, "gpus": gpus}


def uniform(
    name: str,
    nodes: int,
    gpus_per_node: int,
    nvlink_domain_gpus: int,
    bandwidth: Mapping[str, float],
    gpu_name: str = "GPU",
    gpu_memory_gb: float = 0.0,
    nvlinks: int = 0,
    source: str = "described",
) -> Topology:
    """``nodes`` identical nodes; NVLink domains of ``nvlink_domain_gpus`` consecutive GPUs (0: none).

    A domain either divides a node (bridged pairs: 2; NVSwitch node: gpus_per_node) or spans
    whole nodes (NVL72: 72 GPUs = 18 nodes of 4). Ranks are ``node * gpus_per_node + local``.
    """
    for key, val in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if not isinstance(val, int) or val < 1:
            raise TopologyError(f"{key} must be a positive integer, got {val!r}")
    d = nvlink_domain_gpus
    if not isinstance(d, int) or d < 0 or (d and gpus_per_node % d and d % gpus_per_node):
        raise TopologyError(
            f"nvlink_domain_gpus={d!r} must be 0 (no NVLink), divide gpus_per_node={gpus_per_node}, "
            f"or be a multiple of it (a domain spanning whole nodes)"
        )
    gpus = []
    for node in range(nodes):
        for local in range(gpus_per_node):
            rank = node * gpus_per_node + local
            gpus.append(Gpu(node=node, local=local, domain=(rank // d) if d else None, name=gpu_name,
                            memory_gb=float(gpu_memory_gb), nvlinks=nvlinks if d else 0))
    hosts = tuple(f"node{i}" for i in range(nodes))
    return Topology(name=name, nodes=hosts, gpus=tuple(gpus), bandwidth=dict(bandwidth), source=source)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_world(topology: Topology, world_size: int) -> None:
    if world_size != topology.world_size:
        raise TopologyError(
            f"the layout has world_size={world_size} but topology {topology.name!r} has {topology.world_size} GPUs; "
            f"describe {ceil_div(world_size, max(1, topology.world_size // len(topology.nodes)))} node(s) (--nodes) "
            f"or change the layout"
        )


def compact(ranks, limit: int | None = None) -> str:
    """[0,1,2,3,8] -> '0-3,8': rank lists stay readable at 72 GPUs; ``limit`` cuts it with '...'."""
    ranks = list(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    text = ",".join(parts)
    if limit is not None and len(text) > limit:
        text = text[: text.rfind(",", 0, limit) + 1] + "..."
    return text
