"""The bytes a replacement receives when it rejoins under ``[train].fault_tolerance = "replica"``.

Every piece it owns (training/owned_state.py), sent point to point by training/replica_transfer.py: per
owned parameter element its fp32 master and each state tensor the optimizer declares, each kind over the
whole owned range (Muon's momentum and AdamW moments both, unpacked, as a checkpoint holds them). A rank
owns its whole model-parallel shard without ZeRO; with HSDP, its ZeRO shard inside its replica. The
heaviest pipeline stage's rank; the RNG state sent beside it (a few kB) is not counted.
"""

from __future__ import annotations

import math

from .params import rank_params

MASTER_BYTES = 4  # fp32


def joiner_bytes(cfg, layout) -> int:
    per_element = MASTER_BYTES + sum(s.bytes for s in cfg.train.optimizer_declaration.state())
    p = cfg.parallel
    shard, expert_shard = 1, 1
    if p.hsdp_replicas > 1 and p.zero != "no_shard":
        shard = max(layout.dp * layout.cp // p.hsdp_replicas, 1)
        expert_shard = max(layout.edp // p.hsdp_replicas, 1)
    owned = (math.ceil(rank_params(cfg, layout, stage).dense / shard)
             + math.ceil(rank_params(cfg, layout, stage).experts / expert_shard) for stage in range(layout.pp))
    return max(owned) * per_element
