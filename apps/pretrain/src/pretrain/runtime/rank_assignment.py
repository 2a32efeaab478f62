"""Where the trainer's groups go: the topology at start-up, then par_groups' :func:`place`.

Every rank calls :func:`assign_run_ranks` (collectively) before it creates its groups:

1. the topology: each rank asks NVML about its GPU and the views are all-gathered; where NVML
   cannot describe every rank, ``[topology] preset`` or ``file`` from the config; else unknown
   (the groups follow ``[parallel].order`` as before, and the trainer says so once);
2. ``[parallel].rank_assignment``: ``auto`` takes the cheapest order string and rank permutation that
   :func:`par_groups.topology.place` finds, ``strict`` keeps the configured order but refuses
   (one line naming the fix) when tp, ep, expert tp or the CP all-to-all level would leave an
   NVLink domain, ``off`` keeps the configured order without looking.

A placement only decides which process plays which grid position: every rank keeps its logical
coordinates (tp, cp, dp, pp, ep ...), which is what the sampler, the checkpoint blocks and the
logs are keyed by, so losses and checkpoints do not depend on it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from par_groups import RankGrid
from par_groups.topology import (
    LINK_CLASSES,
    RankAssignment,
    Topology,
    TopologyError,
    Workload,
    load_toml,
    local_view,
    merge_views,
    assign_ranks,
    gather_views,
    preset,
)
from par_groups.topology.model import ceil_div
from par_groups.topology.assignment import hungry_off_fast_links

from ..errors import UsageError

UNKNOWN = ("topology unknown (no NVML here and no [topology] preset or file in the config): "
           "groups follow [parallel].order as given")


@dataclass(frozen=True)
class RunAssignment:
    """The grid whose groups this run creates and the permutation of ranks that plays it."""

    grid: RankGrid  # its order may differ from [parallel].order under rank_assignment = "auto"
    permutation: tuple[int, ...] | None  # permutation[i] = global rank of grid position i; None = identity
    message: str  # the one start-up line
    topology: Topology | None = None
    chosen: RankAssignment | None = None


def workload(cfg, layout) -> Workload:
    """What one step of this config moves, for the rank-assignment cost model (and ``plan --auto``'s)."""
    m, t = cfg.model, cfg.train
    cp_comm = cfg.parallel.cp_comm_type if cfg.parallel.cp_comm_type in ("p2p", "a2a", "allgather") else "p2p"
    pb = 4 if t.dtype == "fp32" else 2
    return Workload(hidden=m.hidden, ffn_hidden=m.ffn_hidden, layers=m.layers, seq_len=t.seq_len,
                    micro_batch=layout.micro_batch, microbatches=layout.microbatches, vocab=m.vocab_size,
                    moe_layers=m.num_moe_layers, experts=m.num_experts or None, topk=max(1, m.top_k),
                    expert_ffn_hidden=m.expert_ffn_hidden if m.is_moe else None,
                    cp_comm=cp_comm, act_bytes=pb, **recurrent_cp(cfg, layout, pb, cp_comm))


def recurrent_cp(cfg, layout, pb: int, cp_comm: str) -> dict:
    """A hybrid's CP traffic as its family declares it (``Family.recurrent_state``): its full-attention
    layers move K and V, its recurrent layers their states (the ring kinds) or their heads' inputs and
    outputs (the all-to-alls), per micro-batch; empty for a family without recurrent layers."""
    from ..models import family_of

    m = cfg.model
    kind = cfg.parallel.cp_comm_type if getattr(layout, "hcp", ()) else cp_comm  # the grid's levels decide
    declared = family_of(m).recurrent_state(m, layout, layout.micro_batch, pb, kind)
    if not declared or layout.cp == 1:
        return {}
    linear, tokens = declared["linear_layers"], cfg.train.seq_len // layout.cp * layout.micro_batch
    return {"cp_kv_layers": m.layers - linear,
            "cp_state_bytes": (declared["cp_state_bytes_per_layer"] + declared["cp_halo_bytes_per_layer"]) * linear,
            "cp_a2a_bytes": declared["cp_a2a_bytes_per_token"] * tokens * linear}


def described_topology(cfg, world: int) -> Topology | None:
    """``[topology] preset`` or ``file``, sized to ``world`` GPUs (the first ``world`` of it); None if neither."""
    tc = cfg.topology
    if not (tc.preset or tc.file):
        return None
    try:
        if tc.preset:
            topo = preset(tc.preset, tc.nodes or None)
            if not tc.nodes:
                per_node = topo.world_size // len(topo.nodes)
                topo = preset(tc.preset, max(len(topo.nodes), ceil_div(world, per_node)))
        else:
            topo = load_toml(Path(tc.file), tc.nodes or None)
            per_node = topo.world_size // len(topo.nodes)
            if not tc.nodes and topo.world_size < world and "gpus" not in _toml_keys(tc.file):
                topo = load_toml(Path(tc.file), ceil_div(world, per_node))
    except TopologyError as e:
        raise UsageError(f"[topology]: {e}") from None
    if topo.world_size < world:
        raise UsageError(f"[topology] describes {topo.world_size} GPUs but the run has {world} ranks; "
                         f"raise [topology].nodes or describe more GPUs")
    if topo.world_size > world:  # a part of the cluster: the first `world` GPUs, as a launcher fills them
        topo = replace(topo, gpus=topo.gpus[:world], labels={})
    return topo


def _toml_keys(path: str) -> set[str]:
    import tomllib

    try:
        return set(tomllib.loads(Path(path).read_text()))
    except (OSError, tomllib.TOMLDecodeError):
        return set()


def gathered_topology(views: list[dict]) -> Topology | None:
    """The topology NVML gives when every rank's view has its GPU; None when any rank lacks NVML."""
    if not views or any(v["gpu"] is None for v in views):
        return None
    return merge_views(views)


def find_topology(cfg, world: int) -> Topology | None:
    """Collective: NVML views of every rank all-gathered, else the config's description, else None."""
    import torch.distributed as dist

    view = local_view(int(os.environ.get("LOCAL_RANK", "0")))
    views = gather_views(view) if dist.is_initialized() and world > 1 else [view]
    return gathered_topology(views) or described_topology(cfg, world)


def choose_assignment(cfg, layout, topology: Topology | None) -> RunAssignment:
    """The grid and permutation for ``[parallel].rank_assignment`` on ``topology``; UsageError under strict."""
    grid, mode = layout.grid, cfg.parallel.rank_assignment
    if mode == "off":
        return RunAssignment(grid, None, f"placement off: groups follow order {grid.order} as given", topology)
    if topology is None:
        return RunAssignment(grid, None, UNKNOWN)
    try:
        best = assign_ranks(grid, topology, workload(cfg, layout))
    except (TopologyError, ValueError) as e:
        raise UsageError(f"placement on {topology.name}: {e}") from None
    given = best.given
    if mode == "strict":
        if hungry_off_fast_links(given):
            raise UsageError(strict_refusal(given, best))
        chosen = given
    else:
        chosen = best
    perm = None if chosen.is_identity else tuple(chosen.permutation)
    line = summary(chosen, given, mode)
    spread = route_node_spread(cfg.model.max_route_nodes, cfg.model.n_groups, chosen.grid, perm, topology)
    return RunAssignment(chosen.grid, perm, f"{line}; {spread}" if spread else line, topology, chosen)


def route_node_spread(max_route_nodes: int, n_groups: int, grid: RankGrid, permutation, topology: Topology) -> str:
    """'' or a warning: an expert group's EP ranks span several nodes, so ``[model].max_route_nodes``
    (one group per node) does not bound the nodes a token reaches."""
    if not max_route_nodes or grid.ep <= n_groups:  # off, or every group on one EP rank
        return ""
    per_group = grid.ep // n_groups
    for ep_group in grid.expert_ranks("ep"):
        placed = [permutation[i] if permutation else i for i in ep_group]
        for first in range(0, grid.ep, per_group):
            nodes = {topology.gpus[r].node for r in placed[first:first + per_group]}
            if len(nodes) > 1:
                return (f"warning: [model].max_route_nodes={max_route_nodes} does not bound the nodes a token "
                        f"reaches: expert group {first // per_group} is on ranks {placed[first:first + per_group]} "
                        f"of {len(nodes)} nodes; each {per_group} consecutive EP ranks (ep/n_groups) should share one")
    return ""


def strict_refusal(given: RankAssignment, best: RankAssignment) -> str:
    """One line: which hungry group leaves NVLink under the configured order, and the fix."""
    warning = given.warnings[0].split(". Fix:")[0] if given.warnings else "a bandwidth-hungry group leaves NVLink"
    if hungry_off_fast_links(best) == 0:
        fix = (f'set [parallel].order = "{best.order}"' if best.is_identity else
               'set [parallel].rank_assignment = "auto" (the ranks must also be permuted: the launcher interleaved the hosts)')
    else:
        fix = config_words(best.warnings[0].split(". Fix: ")[-1])
    return (f"[parallel].rank_assignment=strict: with order {given.order}, {warning}. Fix: {fix}, "
            f'or set [parallel].rank_assignment = "auto"')


def config_words(text: str) -> str:
    """par_groups' fixes name CLI flags (``--tp 8``); the trainer's user writes ``parallel.tp=8``."""
    return re.sub(r"--(\w+)(?: (\d[\d,]*))?", lambda m: f"parallel.{m[1]}" + (f"={m[2]}" if m[2] else ""), text)


def summary(chosen: RankAssignment, given: RankAssignment, mode: str) -> str:
    """The start-up line: which groups stay on NVLink, which cross slower links, estimated comm time."""
    by_link: dict[str, list[str]] = {}
    for name, g in chosen.groups.items():
        by_link.setdefault(g.link, []).append(name)
    where = "; ".join(f"{_LINK_WORDS[link]}: {', '.join(by_link[link])}" for link in LINK_CLASSES if link in by_link)
    head = f"placement {mode} on {chosen.topology.describe().split(':')[0]} ({chosen.topology.source})"
    if chosen.order != given.order or not chosen.is_identity:
        what = f"order {chosen.order} instead of {given.order}" + ("" if chosen.is_identity else ", ranks permuted")
    else:
        what = f"order {chosen.order} as given"
    cost = (f"estimated exposed communication {chosen.cost_s * 1e3:.3g} ms/step "
            f"(the configured order: {given.cost_s * 1e3:.3g} ms)")
    line = f"{head}: {what}; {where or 'every group has one rank'}; {cost}"
    if chosen.warnings:  # no order keeps every hungry group inside a domain
        line += f"; warning: {config_words(chosen.warnings[0])}"
    return line


_LINK_WORDS = {"nvlink": "on NVLink", "pcie": "over PCIe", "network": "across the network"}


def assign_run_ranks(cfg, layout, topology: Topology | None = None) -> RunAssignment:
    """Collective (every rank): find the topology unless given, then :func:`choose_assignment`."""
    if topology is None and cfg.parallel.rank_assignment != "off":
        topology = find_topology(cfg, layout.world_size)
    return choose_assignment(cfg, layout, topology)


def check_before_launch(cfg, layout) -> RunAssignment:
    """A standalone launch (all ranks on this host): the same decision in the launching process, so
    ``strict`` refuses with exit 2 before any rank starts."""
    if cfg.parallel.rank_assignment == "off":
        return choose_assignment(cfg, layout, None)
    views = [local_view(r) for r in range(layout.world_size)]
    return choose_assignment(cfg, layout, gathered_topology(views) or described_topology(cfg, layout.world_size))
