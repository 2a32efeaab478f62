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
    """buddy_shards=1: par's ZeRO-1, 2 or 3 over the whole dp group, an element-wise optimizer, no expert parallelism.
    torch's FSDP2 keeps its shards in its own DTensors, which hold no second (buddy) range."""
    p, t = cfg.parallel, cfg.train
    if not t.buddy_shards:
        return
    _need(p.zero != "torch_fsdp2",
          f"[train].buddy_shards=1 steps a second shard inside par's own ZeRO, not torch's FSDP2 (zero='torch_fsdp2'): "
          f"use [parallel].zero='optim_grads_params' (par's ZeRO-3) with buddy_shards=1, or hsdp_replicas >= 2 with "
          f"buddy_shards=0")
    _need(p.zero in BUDDIES and p.hsdp_replicas == 1 and p.ep == 1 and t.optimizer_declaration.elementwise,
          f"[train].buddy_shards=1 runs with [parallel].zero='optim', 'optim_grads' or 'optim_grads_params' over the whole "
          f"dp (hsdp_replicas=1), ep=1 and an element-wise optimizer; got zero={p.zero!r}, hsdp_replicas={p.hsdp_replicas}, ep={p.ep}, "
          f"optimizer={t.optimizer!r}: set buddy_shards=0 or change them")
    zero3 = [f"{key}={value}" for key, value, unsupported in (
        ("[parallel].pp", p.pp, p.pp > 1), ("[model].num_experts", cfg.model.num_experts, cfg.model.num_experts > 0),
        ("[data].eod_mask_loss", "true", cfg.data.eod_mask_loss), ("[parallel].dynamic_cp", "true", p.dynamic_cp))
        if unsupported]
    _need(p.zero != "optim_grads_params" or t.fault_tolerance != "replica" or not zero3,
          f"[train].buddy_shards=1 under zero='optim_grads_params' pads a replica's micro-batches to the busiest "
          f"replica's count (training/replica_padding.py), built for dense models at pp=1 without eod_mask_loss or "
          f"dynamic_cp so far; got {', '.join(zero3)}: use zero='optim' or 'optim_grads' with buddy_shards=1, or drop them")


def fault_tolerance_world(cfg, dp: int) -> None:
    """Another replica to go on with: dp >= 2. Dynamic CP: a document of a whole window fits the dp x cp ranks of
    one replica, the fewest a generation may plan the global batch over."""
    p, t = cfg.parallel, cfg.train
    if t.fault_tolerance != "replica":
        return
    _need(dp >= 2, f"[train].fault_tolerance='replica' needs dp >= 2 (got dp={dp}): a lost replica's state has no other "
                   f"copy; start more ranks or set fault_tolerance='off'")
    ranks = p.cp * (dp // p.hsdp_replicas if p.hsdp_replicas > 1 else 1)
    _need(not p.dynamic_cp or t.seq_len <= p.max_seq_per_rank * ranks,
          f"[train].fault_tolerance='replica' with [parallel].dynamic_cp=true needs a document of a whole window "
          f"([train].seq_len={t.seq_len}) to fit the {ranks} dp x cp ranks of one replica (what a generation may be left "
          f"with) at [parallel].max_seq_per_rank={p.max_seq_per_rank}; raise max_seq_per_rank to at least "
          f"{-(-t.seq_len // ranks)} or set fault_tolerance='off'")


def fault_tolerance_experts(cfg, layout) -> None:
    """HSDP with expert parallelism: each HSDP replica holds a whole copy of the experts (model/build.py shards them
    inside it) only where every expert-parallel group lies inside one replica; else a lost replica's experts
    have no live copy."""
    p = cfg.parallel
    if cfg.train.fault_tolerance != "replica" or p.ep == 1 or p.hsdp_replicas == 1 or layout.dp % p.hsdp_replicas:
        return
    shard, grid = layout.dp // p.hsdp_replicas, layout.grid
    split = next((g for g in grid.expert_ranks("tp-ep") if len({grid.coords(r)["dp"] // shard for r in g}) > 1), None)
    _need(split is None, f"[train].fault_tolerance='replica' with [parallel].ep={p.ep} and hsdp_replicas={p.hsdp_replicas} "
                         f"needs each expert-parallel group inside one HSDP replica ({shard} data ranks), but ranks "
                         f"{split} span replicas, whose experts would have no live copy: make dp / hsdp_replicas a "
                         f"multiple of ep, or set fault_tolerance='off'")


def fault_tolerance_nodes(cfg, layout, nproc: int, nnodes: int, torchrun: bool = False) -> None:
    """Several torchruns (``--nnodes``): each agent stops only its own workers, and no launcher fences a lost
    replica's ranks on another node, so each replica (the ranks one loss ends: a dp coordinate, an HSDP replica's
    sharding group, an expert-parallel group) must lie on one node. `pretrain train` launchers fence a replica over
    several nodes (node_fences.py), with node 0's store or the store apart."""
    if cfg.train.fault_tolerance != "replica" or nnodes == 1 or not torchrun:
        return
    p = cfg.parallel
    shard = layout.dp // p.hsdp_replicas if p.hsdp_replicas > 1 else p.ep
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
