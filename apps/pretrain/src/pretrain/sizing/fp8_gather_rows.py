"""Which layouts ``[train].fp8_param_gather`` can shard: ZeRO-3 gives each of its sharding ranks whole rows
of every weight an FP8 linear multiplies by (model/fp8_gather.py), and under blockwise whole 128-row blocks
(each rank quantizes its own 128x128 tiles). In closed form from the model's shapes, so that `plan` refuses
and `plan --auto` skips such a layout before the trainer would at build time.

The weights (model/fp8.py's FP8 linears): the attention's matrices, the dense MLP's, the shared experts'
and MTP's ``eh_proj``; not the routed experts, the router, the embeddings, the norms or the output layer.
Their rows on one tp rank: a column-parallel weight's (split by heads, KV heads, the MLP width) over tp,
a row-parallel one's (``o_proj``, ``out_proj``, ``down_proj``: the hidden size) and a replicated one's
(MLA's down-projections, the shared experts, ``eh_proj``) whole, a KV projection one head's when tp does
not divide the KV heads.
"""

from __future__ import annotations

from functools import lru_cache

from par_tp.fp8 import RECIPES

from ..model.shapes import full_shapes
from ..models import family_of

ROW_PARALLEL = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
COLUMN_MLP = ("gate_proj.weight", "up_proj.weight")


@lru_cache(maxsize=64)  # --auto asks once per shape
def fp8_weight_rows(m, tp: int) -> dict[str, int]:
    """{full (Hugging Face) name: rows on one tp rank} of each weight the FP8 parameter gather shards."""
    family = family_of(m)
    out = {}
    for name, shape in full_shapes(m).items():
        tail = ".".join(name.split(".")[-2:])
        if len(shape) != 2 or ".layers." not in name or "norm" in name or ".router." in name or tail == "gate.weight":
            continue
        if not name.endswith(".weight") and not name.endswith((".w_gate", ".w_up", ".w_down")):
            continue
        rows = shape[0]
        if tail in ROW_PARALLEL:
            pass
        elif tail in family.tp_split or tail in COLUMN_MLP:
            rows //= tp
        elif tail in family.kv_split:
            rows = rows // tp if m.kv_heads % tp == 0 else rows // m.kv_heads
        out[name] = rows
    return out


def fp8_gather_misfit(cfg, layout, shards: int) -> str | None:
    """None when every FP8-gathered weight splits into whole rows (blockwise: 128-row blocks) over
    ``shards`` ZeRO-3 sharding ranks; else the one error line the trainer would give at build time."""
    t = cfg.train
    if not t.fp8_param_gather or t.fp8 not in RECIPES or shards <= 1:
        return None
    block = RECIPES[t.fp8].weight_block
    rows_per_block = block[0] if block is not None else 1
    for name, rows in fp8_weight_rows(cfg.model, layout.tp).items():
        if rows % (shards * rows_per_block):
            fits = [d for d in (1, 2, 4, 8, 16, 32, 64) if rows % (d * rows_per_block) == 0]
            unit = f"{rows_per_block}-row blocks" if rows_per_block > 1 else "rows"
            return (f"[train].fp8_param_gather=true with fp8={t.fp8!r}: the weight {name} has {rows} rows per tp "
                    f"rank, which do not split over the {shards} ZeRO-3 sharding ranks (dp x cp / hsdp_replicas) into "
                    f"whole {unit}; sharding ranks in {fits} would fit (or fp8_param_gather=false)")
    return None
