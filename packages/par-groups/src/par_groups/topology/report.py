"""Readable text for a topology (in the spirit of ``nvidia-smi topo -m``) and for a placement."""

from __future__ import annotations

from .model import Topology, compact
from .assignment import RankAssignment

LEGEND = ("Legend: X = self, NV# = NVLink (# active links), NV = NVLink (fabric), "
          "PIX/PXB/PHB/NODE/SYS = PCIe path (same switch / switches / host bridge / NUMA node / across sockets), "
          "PCIe = same node without NVLink, NET = across nodes")


def render_topology(topo: Topology, matrix_nodes: int = 1) -> str:
    lines = [f"Topology {topo.describe()}", f"source: {topo.source}"]
    lines += [f"  {n}" for n in topo.notes]
    node_ranks = topo.node_ranks()
    shown = node_ranks if len(node_ranks) <= 4 else node_ranks[:2]
    for node, ranks in enumerate(shown):
        names = sorted({topo.gpus[r].name for r in ranks})
        mem = max(topo.gpus[r].memory_gb for r in ranks)
        lines.append(f"node {node} ({topo.nodes[node]}): ranks {compact(ranks)}, {len(ranks)} x {'/'.join(names)}"
                     + (f", {mem:g} GB" if mem else ""))
    if len(shown) < len(node_ranks):
        lines.append(f"... {len(node_ranks) - len(shown)} more node(s), up to node {len(node_ranks) - 1}")
    for node in range(min(matrix_nodes, len(node_ranks))):
        lines += ["", f"node {node} ({topo.nodes[node]}):"] + _matrix(topo, node_ranks[node])
    domains = topo.domain_ranks()
    if domains:
        lines.append("")
        for i, ranks in enumerate(domains[:8]):
            nodes = sorted({topo.gpus[r].node for r in ranks})
            lines.append(f"NVLink domain {i}: ranks {compact(ranks)} on node(s) {compact(nodes)}")
        if len(domains) > 8:
            lines.append(f"... {len(domains) - 8} more NVLink domain(s)")
    lines += ["", LEGEND]
    return "\n".join(lines)


def _matrix(topo: Topology, ranks: list[int]) -> list[str]:
    head = "        " + "".join(f"{f'GPU{topo.gpus[r].local}':>7}" for r in ranks) + "   NUMA  domain  bus / uuid"
    rows = [head]
    for a in ranks:
        g = topo.gpus[a]
        cells = "".join(f"{topo.label(a, b):>7}" for b in ranks)
        numa = "-" if g.numa is None else str(g.numa)
        dom = "-" if g.domain is None else str(g.domain)
        ident = " ".join(x for x in (g.pci_bus, g.uuid) if x)
        rows.append(f"  {f'GPU{g.local}':<6}{cells}   {numa:>4}  {dom:>6}  {ident}")
    others = [r for r in range(topo.world_size) if r not in set(ranks)]
    if others:
        same = [r for r in others if topo.link(ranks[0], r) == "nvlink"]
        lines = "  to other nodes: NET" + (f", except NV to ranks {compact(same)} (same NVLink domain)" if same else "")
        rows.append(lines)
    return rows


def render_assignment(p: RankAssignment, groups_shown: int = 2) -> str:
    how = "identity placement (rank i plays grid position i)" if p.is_identity else \
        f"explicit permutation[i] = rank: {list(p.permutation)}"
    g = p.grid
    lines = [f"Rank assignment of world={g.world_size} tp={g.tp} cp={g.cp} pp={g.pp} dp={g.dp} ep={g.ep} etp={g.etp} "
             f"edp={g.edp}" + (f" hcp={list(g.hcp)}" if g.hcp else "") + f" on {p.topology.describe()}",
             f"order {p.order}, {how}"]
    if p.given is not None:
        lines.append(f"cost model: {p.cost_s * 1e3:.3g} ms exposed communication per step; the given order "
                     f"{p.given.order} costs {p.given.cost_s * 1e3:.3g} ms ({p.candidates} order/permutation pairs tried)")
    lines.append("")
    lines.append(f"  {'group':<7}{'size':>5}{'count':>6}  {'link':<8}{'GB/s':>7}{'MB/step':>10}{'ms/step':>9}  groups")
    for name, gp in p.groups.items():
        shown = " ".join(f"[{compact(r, 40)}]" for r in gp.ranks[:groups_shown])
        if len(gp.ranks) > groups_shown:
            shown += " ..."
        mb = f"{gp.bytes_per_step / 1e6:.1f}" if gp.bytes_per_step else "-"
        ms = f"{gp.seconds * 1e3:.3g}" if gp.seconds else "-"
        lines.append(f"  {name:<7}{gp.size:>5}{len(gp.ranks):>6}  {gp.link:<8}{gp.gbps:>7g}{mb:>10}{ms:>9}  {shown}")
    if not p.groups:
        lines.append("  (every group has one rank: nothing to place)")
    lines.append("")
    if p.warnings:
        lines.append("warnings:")
        lines += [f"  - {w}" for w in p.warnings]
    else:
        lines.append("no warnings: tp, ep and the CP all-to-all stay on the fastest links")
    return "\n".join(lines)
