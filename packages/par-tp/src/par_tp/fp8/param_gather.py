"""FP8 parameter all-gather (ZeRO-3 / HSDP): each rank quantizes its own shard of a weight's rows and the
gather moves FP8 bytes and scales (about half of bf16's) instead of the high-precision weight.

The gathered :class:`~par_tp.fp8.quantize.Quantized` is bitwise the single device's quantization of the
whole weight when a scale never needs rows of another rank: tensorwise takes the MAX of the shards' amaxes
over the gather group (the ranks holding pieces of the tensor, never other data), blockwise needs each
shard's rows to be whole 128-row weight blocks. It serves the forward and, transposed, the input gradient
(:meth:`Quantized.t`): a tensor's amax and a 128x128 block's are the same transposed. Rowwise and MXFP8
scale the weight along K forward and along N backward, two quantizations no one gather gives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from par_groups import comm

from .quantize import Quantized, max_reduce_, quantize
from .recipes import RECIPES, Recipe

GATHERED = ("tensorwise", "blockwise")  # recipes whose one gathered weight serves both its GEMMs


def _recipe(recipe: str | Recipe) -> Recipe:
    r = RECIPES[recipe] if isinstance(recipe, str) else recipe
    if r.name not in GATHERED:
        raise ValueError(f"fp8 parameter gather with fp8={r.name!r}: its forward and backward scale the weight "
                         f"along different dims; use {' or '.join(map(repr, GATHERED))}")
    return r


def gather_bytes(rows: int, cols: int, recipe: str | Recipe, amax_groups: int = 1) -> int:
    """Bytes one gather of a ``[rows, cols]`` weight moves (the gathered size, as par_groups.comm records it):
    one byte per element and, for blocks, one fp32 scale per block (tensorwise: a 4-byte MAX all-reduce
    of the amax over each of its ``amax_groups`` nontrivial groups, the gather's and the weight's tp; each
    rank makes the scale from it)."""
    r = _recipe(recipe)
    if r.weight_block is None:
        return rows * cols + 4 * amax_groups
    br, bc = r.weight_block
    return rows * cols + 4 * (-(-rows // br)) * (-(-cols // bc))


def gather_quantized(shard: torch.Tensor, recipe: str | Recipe, group: ProcessGroup | None,
                     amax_groups: tuple[ProcessGroup, ...] = ()) -> Quantized:
    """The whole weight ``[rows, cols]`` in FP8 from this rank's equal share of its rows ``shard``.
    ``amax_groups``: the other groups splitting the weight (a TP layer's tp), whose ranks' pieces a
    tensorwise amax covers too, as the FP8 linear's own quantization of it does."""
    r = _recipe(recipe)
    n = dist.get_world_size(group)
    rows, cols = shard.shape
    if r.weight_block is None:
        amax = max_reduce_(shard.abs().max().float().reshape(()).clone(), (group,) + tuple(amax_groups))
        q = quantize(shard, r, "weight", amax=amax, what="gather w shard")
        scale = q.scale
    else:
        br = r.weight_block[0]
        if rows % br and n > 1:
            raise ValueError(f"fp8 parameter gather with fp8={r.name!r}: a shard of {rows} rows is not whole "
                             f"{br}-row weight blocks; shard the weight in multiples of {br} rows")
        q = quantize(shard, r, "weight", what="gather w shard")
        scale = torch.empty(n * q.scale.shape[0], q.scale.shape[1], dtype=q.scale.dtype, device=shard.device)
        comm.all_gather_into_tensor(scale, q.scale.contiguous(), group)
    data = torch.empty(n * rows, cols, dtype=q.data.dtype, device=shard.device)
    comm.all_gather_into_tensor(data, q.data, group)
    return Quantized(data, scale, q.block)
