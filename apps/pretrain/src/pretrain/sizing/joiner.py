"""The bytes a replacement receives when it rejoins under ``[train].fault_tolerance = "replica"``.

Every piece it owns (training/owned_state.py), sent point to point by training/replica_transfer.py: per
owned parameter element its fp32 master and each state tensor the optimizer declares, each kind over the
whole owned range (Muon's momentum and AdamW moments both, unpacked, as a checkpoint holds them), and the
routers' expert bias of its MoE layers. A rank
owns its whole model-parallel shard without ZeRO; with HSDP, its ZeRO shard inside its replica. The
heaviest pipeline stage's rank; the RNG state sent beside it (a few kB) is not counted.
"""

from __future__ import annotations

import math

from .params import rank_params
from .replicas import stage_moe_layers

MASTER_BYTES = 4  # fp32
ROUTER_BIAS_BYTES = 4  # fp32, per expert of each MoE layer


def joiner_bytes(cfg, layout) -> int:
    per_element = MASTER_BYTES + sum(s.bytes for s in cfg.train.optimizer_declaration.state())
    p = cfg.parallel
    shard, expert_shard = 1, 1
    if p.hsdp_replicas > 1 and p.zero != "no_shard":
        shard = max(layout.dp * layout.cp // p.hsdp_replicas, 1)
        expert_shard = max(layout.edp // p.hsdp_replicas, 1)
    def owned(stage: int) -> int:
        params = rank_params(cfg, layout, stage)
        elements = math.ceil(params.dense / shard) + math.ceil(params.experts / expert_shard)
        # beside the parameters, the routers' expert bias (fp32, whole: the balancing's state)
        return elements * per_element + ROUTER_BIAS_BYTES * cfg.model.num_experts * stage_moe_layers(cfg, layout, stage)

    return max(owned(stage) for stage in range(layout.pp))
