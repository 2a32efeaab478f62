"""FP8 parameter all-gather under ZeRO-3 / HSDP (``[train].fp8_param_gather = true``).

Every weight an FP8 linear multiplies by (model/fp8.py's: the TP layers', the shared experts', MLA's and
MTP's ``nn.Linear``) gets a ZeRO-3 bucket of its own whose shard is whole rows of it; its unit gathers it
with par_tp.fp8.gather_quantized instead of the bf16 all-gather: each rank quantizes the rows it holds, the
gather moves FP8 bytes and scales (tensorwise: one amax MAX-reduced over the sharding group and the groups
the FP8 linear reduces it over; blockwise: the shard's 128x128 tiles, no reduction), and the linear takes
that weight, bitwise its own quantization of the gathered values, for its forward and, transposed, its
input gradient. The experts' grouped weights, the embedding, the norms, the router and the output layer
are gathered in bf16 as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from par_moe.experts import SwiGLU
from par_tp.fp8 import FP8LinearKernel, RECIPES, gather_quantized

from ..errors import UsageError


@dataclass(frozen=True)
class FP8Gather:
    """par_zero's ``gather(shard, group)`` for one weight: its recipe and the other groups splitting it."""

    recipe: str
    amax_groups: tuple

    def __call__(self, shard, group):
        return gather_quantized(shard, self.recipe, group, self.amax_groups)


def _fp8_weights(chunk: nn.Module):
    """(name, weight, kernel) of each weight an FP8 linear of ``chunk`` multiplies by."""
    for name, m in chunk.named_modules():
        kernel = getattr(m, "fp8_kernel" if type(m) is nn.Linear else "linear_kernel", None)
        if not isinstance(kernel, FP8LinearKernel):
            continue
        for attr in ("w_gate", "w_up", "w_down") if isinstance(m, SwiGLU) else ("weight",):
            yield f"{name}.{attr}", getattr(m, attr), kernel


def fp8_gathered_weights(chunks, recipe: str, shards: int) -> dict[nn.Parameter, FP8Gather]:
    """``{weight: its FP8 gather}`` for par_zero's ``gathered_as``; ``shards``: the ZeRO-3 sharding group's
    size. One error line when a weight's rows do not split into whole shards (blockwise: of 128-row blocks)."""
    block = RECIPES[recipe].weight_block
    rows_per_block = block[0] if block is not None and shards > 1 else 1  # one rank holds whole blocks
    out = {}
    for chunk in chunks:
        for name, w, kernel in _fp8_weights(chunk):
            rows = w.shape[0]
            if rows % (shards * rows_per_block):
                raise UsageError(
                    f"[train].fp8_param_gather=true with fp8={recipe!r}: the weight {name} has {rows} rows here, "
                    f"which do not split over the {shards} ZeRO-3 sharding ranks (dp x cp / hsdp_replicas) into "
                    f"whole {f'{rows_per_block}-row blocks' if rows_per_block > 1 else 'rows'}; use fewer sharding "
                    f"ranks, or fp8_param_gather=false")
            s = kernel.sharding
            out[w] = FP8Gather(recipe, tuple(s.in_features) + tuple(s.out_features))
    return out
