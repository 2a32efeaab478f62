"""What ``[train].fault_tolerance = "replica"`` runs with, refused up front in one line.

A lost replica's state must live on elsewhere: every survivor holds all of its model-parallel
coordinate's state only when data parallelism does not shard it (ZeRO over the whole dp leaves a
lost replica's shards nowhere), and there must be another replica (dp >= 2). Under HSDP each replica holds
a whole copy of the experts only where every expert-parallel group lies inside one replica.
"""

from __future__ import annotations

from .rules import _need

SHARDED = ("optim", "optim_grads", "optim_grads_params", "torch_fsdp2")
BUDDIES = ("optim", "optim_grads", "optim_grads_params")  # the ZeRO levels buddy shards run with (par_zero/buddy.py)


def fault_tolerance_rules(cfg) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    buddy_rules(cfg)
    if t.fault_tolerance != "replica":
        return
    _need(p.zero not in SHARDED or p.hsdp_replicas >= 2 or t.buddy_shards,
          f"[train].fault_tolerance='replica' needs a live copy of each replica's state, but [parallel].zero={p.zero!r} "
          f"shards it over the whole dp (hsdp_replicas={p.hsdp_replicas}): use zero='no_shard', hsdp_replicas >= 2, "
          f"or zero='optim', 'optim_grads' or 'optim_grads_params' with [train].buddy_shards=1")
    _need(not (t.buddy_shards and t.nan_policy == "skip" and m.bias_update_rate > 0),
          f"[train].fault_tolerance='replica' with [train].buddy_shards=1 and nan_policy='skip' runs without aux-loss-free "
          f"balancing so far (a joiner re-sharded after a skipped update would miss its kept expert counts); got "
          f"[model].bias_update_rate={m.bias_update_rate}: set it to 0, nan_policy='stop' or buddy_shards=0")


def buddy_rules(cfg) -> None:
    """buddy_shards=1: par's ZeRO-1, 2 or 3 over the whole dp group, an element-wise optimizer (Muon: ZeRO-1 or 2
    without expert parallelism); with expert
    parallelism ZeRO-1 or 2 (the experts' buddy the next expert-dp rank, the dense params' the next replica's rank).
    torch's FSDP2 keeps its shards in its own DTensors, which hold no second (buddy) range."""
    p, t = cfg.parallel, cfg.train
    if not t.buddy_shards:
        return
    _need(p.zero != "torch_fsdp2",
          f"[train].buddy_shards=1 steps a second shard inside par's own ZeRO, not torch's FSDP2 (zero='torch_fsdp2'): "
          f"use [parallel].zero='optim_grads_params' (par's ZeRO-3) with buddy_shards=1, or hsdp_replicas >= 2 with "
          f"buddy_shards=0")
    matrix = t.optimizer_declaration.gathers == "matrix"  # Muon: its buddy applies its owners' update (par_zero/muon_buddy.py)
    _need(p.zero in BUDDIES and p.hsdp_replicas == 1 and (t.optimizer_declaration.elementwise or matrix),
          f"[train].buddy_shards=1 runs with [parallel].zero='optim', 'optim_grads' or 'optim_grads_params' over the whole "
          f"dp (hsdp_replicas=1) and an element-wise optimizer or Muon; got zero={p.zero!r}, hsdp_replicas={p.hsdp_replicas}, "
          f"optimizer={t.optimizer!r}: set buddy_shards=0 or change them")
    _need(not matrix or p.zero in ("optim", "optim_grads") and p.ep == 1,
          f"[train].buddy_shards=1 with [train].optimizer={t.optimizer!r} runs with [parallel].zero='optim' or "
          f"'optim_grads' (ZeRO-1/2) and ep=1 so far; got zero={p.zero!r}, ep={p.ep}: use them, or buddy_shards=0")
    # the fp32 grad norm is summed over each rank's ZeRO ranges, so a generation of another dp size may move the clip
    # coefficient by its last bit, which Newton-Schulz over tp-split matrices amplifies (README: fault tolerance)
    _need(not matrix or p.tp == 1 or t.fault_tolerance != "replica",
          f"[train].buddy_shards=1 with [train].optimizer={t.optimizer!r} under fault_tolerance='replica' runs at tp=1 so "
          f"far (got [parallel].tp={p.tp}): use tp=1, zero='no_shard' or hsdp_replicas >= 2 with buddy_shards=0")
    _need(p.ep == 1 or p.zero in ("optim", "optim_grads"),
          f"[train].buddy_shards=1 with [parallel].ep={p.ep} runs with zero='optim' or 'optim_grads' (ZeRO-1/2) so far; "
          f"got zero={p.zero!r}: use one of them, ep=1, or buddy_shards=0")
    _need(p.ep == 1 or cfg.model.expert_balance != "replicate+replace",
          f"[train].buddy_shards=1 with [parallel].ep={p.ep} runs without [model].expert_balance='replicate+replace' so "
          f"far (it moves expert rows with their optimizer state, which the buddy ranges do not follow): use "
          f"expert_balance='replicate' or 'none', or buddy_shards=0")
    zero3 = [f"{key}={value}" for key, value, unsupported in (
        ("[model].num_experts", cfg.model.num_experts, cfg.model.num_experts > 0),
        ("[parallel].dynamic_cp", "true", p.dynamic_cp)) if unsupported]
    _need(p.zero != "optim_grads_params" or t.fault_tolerance != "replica" or not zero3,
          f"[train].buddy_shards=1 under zero='optim_grads_params' pads a replica's micro-batches to the busiest "
          f"replica's count (training/replica_padding.py), built for dense models without dynamic_cp so far; "
          f"got {', '.join(zero3)}: use zero='optim' or 'optim_grads' with buddy_shards=1, or drop them")


def fault_tolerance_world(cfg, dp: int) -> None:
    """Another replica to go on with: dp >= 2. Dynamic CP: a document of a whole window fits the dp x cp ranks of
    one replica, the fewest a generation may plan the global batch over."""
    p, t = cfg.parallel, cfg.train
    if t.fault_tolerance != "replica":
        return
    _need(dp >= 2, f"[train].fault_tolerance='replica' needs dp >= 2 (got dp={dp}): a lost replica's state has no other "
                   f"copy; start more ranks or set fault_tolerance='off'")
    _need(p.hsdp_replicas > 1 or dp // p.ep >= 2,
          f"[train].fault_tolerance='replica' needs two replicas, but dp={dp} is one expert-parallel group ([parallel].ep="
          f"{p.ep}), which a loss takes whole: start dp >= {2 * p.ep} ranks' worth or set fault_tolerance='off'")
    ranks = p.cp * (dp // p.hsdp_replicas if p.hsdp_replicas > 1 else 1)
    _need(not p.dynamic_cp or t.seq_len <= p.max_seq_per_rank * ranks,
          f"[train].fault_tolerance='replica' with [parallel].dynamic_cp=true needs a document of a whole window "
          f"([train].seq_len={t.seq_len}) to fit the {ranks} dp x cp ranks of one replica (what a generation may be left "
          f"with) at [parallel].max_seq_per_rank={p.max_seq_per_rank}; raise max_seq_per_rank to at least "
          f"{-(-t.seq_len // ranks)} or set fault_tolerance='off'")


def replica_data_ranks(p, dp: int) -> int:
    """The data ranks of one replica, lost and regrouped together: an HSDP replica's sharding group, an expert-
    parallel group (its ranks hold one copy of the experts between them), else 1."""
    return dp // p.hsdp_replicas if p.hsdp_replicas > 1 else p.ep


def fault_tolerance_experts(cfg, layout) -> None:
    """The layout's groups leave each replica's state a live copy (:func:`replica_copies`), checked up front on the
    order as given; a rank checks them again on the order and permutation its placement chose."""
    if cfg.train.fault_tolerance != "replica" or layout.dp % cfg.parallel.hsdp_replicas:
        return
    replica_copies(cfg, layout.grid, layout.dp)


def buddy_strides(p) -> tuple[int, int]:
    """par_zero's ``buddy_stride`` of the dense buckets and of the expert ones under the order tp-cp-ep-dp-pp: a
    replica's ranks (an expert-parallel group, each rank's cp ranks) lie consecutive in the dp x cp group, and an
    expert-parallel group takes a replica's cp ranks first, so a replica holds cp ranks of the expert-dp group."""
    return p.ep * p.cp, p.cp


def replica_copies(cfg, grid, dp: int, permutation=None) -> None:
    """Expert parallelism: a replica holds a whole copy of the experts (model/build.py shards them inside an HSDP
    replica) only where every expert-parallel group lies inside one replica. Buddy shards: each ZeRO shard's buddy,
    ``buddy_stride`` ranks further in its group (par_zero; a group's ranks are ordered by global rank, as torch orders
    them), must lie in another replica. Either depends on the rank order (``[parallel].order``, or the one placement
    chose) and the permutation of ranks; else a lost replica's experts or shards have no live copy."""
    p = cfg.parallel
    if cfg.train.fault_tolerance != "replica":
        return
    shard = replica_data_ranks(p, dp)
    replica = {position: grid.coords(position)["dp"] // shard for position in range(grid.world_size)}
    if p.ep > 1:
        split = next((g for g in grid.expert_ranks("tp-ep") if len({replica[r] for r in g}) > 1), None)
        _need(split is None, f"[train].fault_tolerance='replica' with [parallel].ep={p.ep} needs each expert-parallel group "
                             f"inside one replica ({shard} data ranks), but ranks {split} span replicas under order "
                             f"{grid.order!r}, whose experts would have no live copy: put ep inside dp in the order "
                             f"(e.g. tp-cp-ep-dp-pp), make dp / hsdp_replicas a multiple of ep, or set fault_tolerance='off'")
    if not cfg.train.buddy_shards:
        return
    place = list(permutation) if permutation else list(range(grid.world_size))
    by_rank = {place[position]: position for position in range(grid.world_size)}
    dense, expert = buddy_strides(p)
    for groups, stride in ((grid.ranks("dp-cp"), dense), (grid.expert_ranks("dp") if p.ep > 1 else [], expert)):
        for group in groups:
            ordered = sorted(place[position] for position in group)  # the process group's ranks, in torch's order
            own = next((r for i, r in enumerate(ordered) if len(ordered) > 1 and stride % len(ordered) and replica[
                by_rank[r]] == replica[by_rank[ordered[(i + stride) % len(ordered)]]]), None)
            _need(own is None, f"[train].buddy_shards=1 puts each ZeRO shard's copy on the rank {stride} further in its "
                               f"data-parallel group, but under order {grid.order!r} rank {own}'s lies in its own "
                               f"replica, lost with it: put cp and ep inside dp in the order (e.g. tp-cp-ep-dp-pp), "
                               f"or set buddy_shards=0")


def fault_tolerance_nodes(cfg, layout, nproc: int, nnodes: int, torchrun: bool = False) -> None:
    """Several torchruns (``--nnodes``): each agent stops only its own workers, and no launcher fences a lost
    replica's ranks on another node, so each replica (the ranks one loss ends: a dp coordinate, an HSDP replica's
    sharding group, an expert-parallel group) must lie on one node. `pretrain train` launchers fence a replica over
    several nodes (node_fences.py), with node 0's store or the store apart."""
    if cfg.train.fault_tolerance != "replica" or nnodes == 1 or not torchrun:
        return
    p = cfg.parallel
    shard = replica_data_ranks(p, layout.dp)
    nodes: dict[int, set[int]] = {}
    for rank in range(layout.world_size):
        nodes.setdefault(layout.grid.coords(rank)["dp"] // shard, set()).add(rank // nproc)
    split = next((rep for rep, on in sorted(nodes.items()) if len(on) > 1), None)
    _need(split is None, f"[train].fault_tolerance='replica' under torchrun with --nnodes {nnodes} needs each "
                         f"data-parallel replica on one node (an agent stops only its own workers: none fences a lost "
                         f"replica's ranks on another node), but replica {split} spans nodes "
                         f"{sorted(nodes.get(split, ()))} at {nproc} workers per torchrun: make the workers a multiple "
                         f"of the ranks per replica (and pp=1), run `pretrain train` launchers instead, or set "
                         f"fault_tolerance='off'")
