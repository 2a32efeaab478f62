"""The bytes a replacement receives when it rejoins under ``[train].fault_tolerance = "replica"``.

Every piece it owns (training/owned_state.py), sent point to point by training/replica_transfer.py: per
owned parameter element its fp32 master and each state tensor the optimizer declares, each kind over the
whole owned range (Muon's momentum and AdamW moments both, unpacked, as a checkpoint holds them), and the
routers' expert bias of its MoE layers. A rank
owns its whole model-parallel shard without ZeRO; with HSDP, its ZeRO shard inside its replica; with
``[train].buddy_shards`` under ZeRO-1, 2 or 3, its shard and its buddy's. The
heaviest pipeline stage's rank; the RNG state sent beside it (a few kB) is not counted.
"""

from __future__ import annotations

import math

import torch

from .params import rank_params
from .replicas import stage_moe_layers
from .state import BUDDY_LEVELS

MASTER_BYTES = 4  # fp32
ROUTER_BIAS_BYTES = 4  # fp32, per expert of each MoE layer


def joiner_bytes(cfg, layout) -> int:
    per_element = MASTER_BYTES + sum(s.bytes for s in cfg.train.optimizer_declaration.state())
    p = cfg.parallel
    shard, expert_shard = 1, 1
    copies = 1
    if p.hsdp_replicas > 1 and p.zero != "no_shard":
        shard = max(layout.dp * layout.cp // p.hsdp_replicas, 1)
        expert_shard = max(layout.edp // p.hsdp_replicas, 1)
    elif cfg.train.buddy_shards and p.zero in BUDDY_LEVELS:  # its ZeRO-1/2/3 shard and its buddy's
        shard, expert_shard, copies = layout.dp * layout.cp, layout.edp, 2

    def owned(stage: int) -> int:
        params = rank_params(cfg, layout, stage)
        elements = sum(min(n, copies * math.ceil(n / size)) for n, size in ((params.dense, shard),
                                                                            (params.experts, expert_shard)))
        # beside the parameters, the routers' expert bias (fp32, whole: the balancing's state)
        return elements * per_element + ROUTER_BIAS_BYTES * cfg.model.num_experts * stage_moe_layers(cfg, layout, stage)

    return max(owned(stage) for stage in range(layout.pp))


def buddy_costs(cfg, layout, stage: int) -> dict:
    """What ``[train].buddy_shards = 1`` costs a rank of pipeline stage ``stage`` beside plain ZeRO-1, 2 or 3: the
    buddy's optimizer state (a second shard of it; under ZeRO-2/3 a second gradient shard too; under ZeRO-3 with
    fp32 params a second param shard, the buddy's master), and per step the gradients' all-reduce in place of
    their reduce-scatter (each rank sends and receives ``(d - 1) / d`` of its full gradient buffer once more; with Muon,
    of its owners' results too, in the Newton-Schulz dtype). Routed
    experts shard over the expert-dp group (``edp`` ranks, one per replica): theirs are its terms."""
    from par_zero import bytes_per_param

    from .state import rank_state, state_dtypes

    d = layout.dp * layout.cp
    state = rank_state(cfg, layout, stage)
    sharded_grads = cfg.parallel.zero in ("optim_grads", "optim_grads_params")
    zero3_fp32 = cfg.parallel.zero == "optim_grads_params" and state_dtypes(cfg.train)[0] == torch.float32
    full = state.grads / 2 * d if sharded_grads else state.grads  # ZeRO-2/3 hold two shards of the full buffer
    params = rank_params(cfg, layout, stage)
    if params.experts and layout.edp != d:  # the experts' gradients are all-reduced over their edp ranks
        grad = bytes_per_param(*state_dtypes(cfg.train))[1]
        per_step = (params.dense * (d - 1) / d + params.experts * (layout.edp - 1) / layout.edp) * grad
    else:
        per_step = full * (d - 1) / d
    muon = {}
    if cfg.train.optimizer_declaration.gathers == "matrix":  # Muon: the owners' results all-reduced, not reduce-scattered
        from .muon_comm import NS_BYTES

        muon = {"muon_bytes_per_step": NS_BYTES[cfg.train.muon_ns_dtype] * (
            params.muon_dense * (d - 1) / d + params.experts * (layout.edp - 1) / max(layout.edp, 1))}
    return {"optim_bytes": state.optim / 2 if d > 1 else 0.0,
            **({"grad_bytes": state.grads / 2 if d > 1 else 0.0} if sharded_grads else {}),
            **({"param_bytes": state.params / 2 if d > 1 else 0.0} if zero3_fp32 else {}),
            "grad_bytes_per_step": per_step, **muon}
