"""Quantize one GEMM operand ``[rows, K]`` (K: the GEMM's reduction dim) by a recipe, with par's scale rule.

What makes FP8 layout-invariant is which ranks a scale's amax is taken over. A scaling block is the same
under every layout if every shard boundary falls on a block edge, or if its amax is MAX-reduced over
exactly the ranks that hold pieces of it, never over data-parallel replicas (they hold other data):

- tensorwise: one amax, MAX-reduced over every group that shards the operand (``along``: groups sharding
  K, ``across``: groups sharding the rows);
- rowwise: one amax per row, MAX-reduced over ``along`` only (a row-parallel layer's K is split over tp);
- blockwise / MXFP8: one amax per tile, no collective; a sharded dim whose local size is not a multiple of
  the tile would make a tile straddle two ranks, which :func:`check_aligned` refuses.

The arithmetic of tensorwise and rowwise is torchao's (``amax_to_scale`` in float64, ``x * scale`` in
float32, saturated cast); blockwise is DeepSeek-V3's (``scale = amax / 448``, ``x / scale``); MXFP8 is the
OCP MX rule (``scale = 2^(floor(log2 amax) - 8)`` for e4m3, one e8m0 byte). Collectives go through
par_groups.comm, so they are counted.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from par_groups import comm

from .recipes import Recipe

EPS = 1e-12  # torchao's floor under an amax (an all-zero tensor gets a finite scale)
E4M3_EMAX = 8
_taps: ContextVar[list | None] = ContextVar("par_fp8_taps", default=None)  # the largest exponent of e4m3 (448 = 1.75 * 2^8), the MX spec's emax_elem


@dataclass(frozen=True)
class Quantized:
    """An operand ``[rows, K]`` in FP8: ``data`` and its dequantization ``scale`` (``x ~ data * scale``):
    a 0-d tensor (tensorwise), ``[rows, 1]`` (rowwise), or one per tile ``[ceil(rows/br), ceil(K/bc)]``
    (float32, or e8m0 bytes for MXFP8)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None  # the tile, for block scales

    def expanded_scale(self) -> torch.Tensor:
        scale = self.scale.float()
        return scale if self.block is None else expand_tiles(scale, self.block, *self.data.shape)

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.expanded_scale()

    def t(self) -> "Quantized":
        """The transposed tensor's quantization, where that is these bytes transposed: one scale per tensor
        or per square tile (a tensor's and a tile's amax do not change under a transpose)."""
        if self.scale.dim() and (self.block is None or self.block[0] != self.block[1]):
            raise ValueError("only a tensor scale or square tiles quantize the transpose as the same bytes")
        return Quantized(self.data.t().contiguous(), self.scale.t().contiguous() if self.scale.dim() else self.scale,
                         self.block)


@contextmanager
def recording():
    """Collect ``(what, Quantized)`` of every operand quantized inside (what the bytes tests compare)."""
    taps: list = []
    token = _taps.set(taps)
    try:
        yield taps
    finally:
        _taps.reset(token)


def _tapped(what: str, q: Quantized) -> Quantized:
    taps = _taps.get()
    if taps is not None:
        taps.append((what, q))
    return q


def _nontrivial(groups) -> tuple[ProcessGroup, ...]:
    return tuple(g for g in groups if g is not None and dist.get_world_size(g) > 1)


def max_reduce_(amax: torch.Tensor, groups) -> torch.Tensor:
    """MAX over every rank of each group (their union), in place, through the counted layer."""
    for group in _nontrivial(groups):
        comm.all_reduce(amax, group, op=ReduceOp.MAX)
    return amax


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return x.clamp(min=-limit, max=limit).to(dtype)


def check_aligned(what: str, rows: int, cols: int, block: tuple[int, int | None] | None, along, across,
                  recipe: str) -> None:
    """A tile never straddles two ranks: a sharded dim's local size is a multiple of the tile."""
    if block is None or block[1] is None:
        return
    for dim, size, tile, groups in (("rows", rows, block[0], across), ("K", cols, block[1], along)):
        if tile > 1 and _nontrivial(groups) and size % tile:
            degrees = [dist.get_world_size(g) for g in _nontrivial(groups)]
            raise ValueError(f"fp8={recipe!r}: the local {what} {dim} of {size} (sharded over groups of size "
                             f"{degrees}) is not a multiple of the {tile}-wide scaling tile, so a tile would "
                             f"straddle two ranks")


def quantize(x: torch.Tensor, recipe: Recipe, role: str, along=(), across=(), amax: torch.Tensor | None = None,
             what: str = "operand") -> Quantized:
    """``x [rows, K]`` in ``recipe.dtype(role)`` (``role``: ``input``, ``weight`` or ``grad``).
    ``along`` / ``across``: the process groups that shard K / the rows of the full operand.
    ``amax``: an amax already reduced (the caller's, e.g. FP8 parameter gather); default: this tensor's."""
    dtype, block = recipe.dtype(role), recipe.block(role)
    x = x.contiguous()  # row-major data, as the GEMM takes it
    rows, cols = x.shape
    if block is None:  # tensorwise
        if amax is None:
            amax = max_reduce_(x.abs().max().float().reshape(()).clone(), tuple(along) + tuple(across))
        return _tapped(what, _torchao_scaled(x, amax, dtype, recipe.power_of_two_scales))
    if block[1] is None:  # rowwise: the whole row of K
        if amax is None:
            amax = max_reduce_(x.abs().amax(dim=1, keepdim=True).float().contiguous(), along)
        return _tapped(what, _torchao_scaled(x, amax, dtype, recipe.power_of_two_scales))
    check_aligned(what, rows, cols, block, along, across, recipe.name)
    if amax is None:
        amax = tile_amax(x, block)
    limit = torch.finfo(dtype).max
    if recipe.e8m0:
        exponent = torch.frexp(amax)[1] - 1 - E4M3_EMAX  # floor(log2 amax) - emax, exact (no log2 rounding)
        scale = torch.exp2(exponent.clamp(-127, 127).float())
    else:
        scale = amax.clamp(min=EPS) / limit
    data = saturate(x.float() / expand_tiles(scale, block, rows, cols), dtype)
    stored = scale.to(torch.float8_e8m0fnu) if recipe.e8m0 else scale
    return _tapped(what, Quantized(data, stored, block))


def expand_tiles(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """One value per element from one per tile."""
    br, bc = block
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def tile_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The amax of each ``br x bc`` tile of ``x`` (a partial last tile takes what is there), float32."""
    rows, cols = x.shape
    br, bc = block
    pr, pc = -rows % br, -cols % bc
    padded = torch.nn.functional.pad(x.float().abs(), (0, pc, 0, pr))
    return padded.view((rows + pr) // br, br, (cols + pc) // bc, bc).amax(dim=(1, 3))


def _torchao_scaled(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool) -> Quantized:
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return Quantized(saturate(x.float() * scale, dtype), scale.reciprocal())
