"""par's tile-scaled FP8 (blockwise, MXFP8) under a layout: no scaling tile may straddle two ranks.

Tile scales need no collective exactly when every shard boundary falls on a tile edge: each dim a layout
splits must have a local size that is a multiple of the tile (128 for blockwise, 32 for MXFP8). The dims
split are the TP-sharded features of the attention and MLP (heads x head width, kv heads x head width when
they divide over tp, the MLP width) and, under cp, the tokens of one load-balanced chunk (seq_len / 2cp
positions of each micro-batch's sequences, the weight gradient's reduction dim). Tensorwise and rowwise
reduce their amaxes instead and fit every layout.
"""

from __future__ import annotations

from par_tp.fp8 import RECIPES

from ..models import family_of
from .rules import _need


def _split_dims(cfg, layout) -> list[tuple[str, int, str, int]]:
    """(what, full size, the [parallel] key that splits it, its degree) for each dim the layout splits."""
    m, t = cfg.model, cfg.train
    dims = []
    if layout.tp > 1:
        dims += [(what, width, "tp", layout.tp) for what, width in family_of(m).tp_split_widths(m, layout.tp)]
        dims.append(("[model].ffn_hidden", m.ffn_hidden, "tp", layout.tp))
    if layout.cp > 1:
        dims.append((f"the tokens of a cp chunk ([train].seq_len={t.seq_len} x micro-batch {layout.micro_batch})",
                     t.seq_len * layout.micro_batch // 2, "cp", layout.cp))
    return dims


def fp8_tile_rule(cfg, layout) -> None:
    """One error line naming the first dim a tile would straddle, and the degrees that would fit it."""
    recipe = RECIPES.get(cfg.train.fp8)
    tile = recipe.block_multiple if recipe is not None else 1
    if tile == 1:
        return
    for what, full, key, degree in _split_dims(cfg, layout):
        local = full // degree
        fits = [d for d in (1, 2, 4, 8, 16, 32, 64) if full % (d * tile) == 0 and d <= 64] or [1]
        _need(local % tile == 0,
              f"[train].fp8={cfg.train.fp8!r} scales {tile}-wide tiles that must not straddle ranks: {what} = "
              f"{full} / {key}={degree} is {local} per rank, not a multiple of {tile}; [parallel].{key} in "
              f"{fits} would fit (or fp8='tensorwise' / 'rowwise', whose scales are reduced instead)")


def fp8_expert_rule(cfg, layout) -> None:
    """FP8 experts quantize each source rank's rows of an expert apart (par_tp.fp8.grouped), which is the
    single rank's quantization when every source holds whole micro-batches of its own: not a cp chunk, not
    one tp rank's sequence-parallel share (expert tp below tp), not a replica's part of an expert's tokens,
    not rows padded to a capacity."""
    m, t = cfg.model, cfg.train
    if t.fp8 not in RECIPES or not m.is_moe:
        return
    bad = [(f"[parallel].cp={layout.cp}", "cp=1") if layout.cp > 1 else None,
           (f"[parallel].etp={layout.expert_tp} below tp={layout.tp}", f"etp={layout.tp}")
           if layout.expert_tp != layout.tp else None,
           (f"[model].dispatcher={m.dispatcher!r}", "'alltoall' or 'allgather'") if m.dispatcher == "alltoall_padded" else None,
           (f"[model].expert_balance={m.expert_balance!r}", "'none'") if m.expert_balance != "none" else None]
    for what, fits in filter(None, bad):
        _need(False, f"[train].fp8={t.fp8!r} quantizes each expert's rows per source rank, which must hold whole "
                     f"micro-batches of its own: {what} splits them; use {fits} (or fp8='off')")
