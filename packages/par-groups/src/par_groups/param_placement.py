"""How a parameter is placed: its block of the full tensor, who else holds it, who owns its grad.

The layer that creates a parameter declares this once (:func:`declare_`); data parallelism,
gradient norms, partial-gradient sums and checkpoints read it (:func:`placement_of`), so nothing
re-derives a layout from attribute conventions.

- ``full_shape`` / ``offsets``: the local tensor is ``full[offsets[d] : offsets[d] + shape[d]]``
  (a TP or expert shard; the whole tensor when nothing splits it).
- ``copies`` (a model-parallel group) with ``span``: identical copies of this block sit on runs of
  ``span`` consecutive ranks of ``copies`` (0 = the whole group): TP-replicated norms, KV heads
  replicated when there are fewer KV heads than TP ranks. Data-parallel replicas are not listed:
  the data-parallel wrapper owns those.
- ``partial_grad``: each copy's gradient is a share (it saw other tokens or other query heads);
  the true gradient is their sum over the copies (:func:`sum_partial_grads_`).
- ``expert``: data-parallel over the expert DP group (the expert family) instead of the dense one.
- ``rows``: dim 0 of the local block holds these rows of the full tensor, in order (a permuted block:
  re-placed experts, see par_moe.placement); None: rows ``offsets[0] ...`` (a contiguous block).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import comm

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class ParamPlacement:
    shape: tuple[int, ...]  # the local block
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    copies: ProcessGroup | None = None
    span: int = 0
    partial_grad: bool = False
    expert: bool = False
    rows: tuple[int, ...] | None = None

    def copy_count(self) -> int:
        """How many model-parallel ranks hold this very block (1: only this one)."""
        if self.copies is None:
            return 1
        return self.span or dist.get_world_size(self.copies)

    def counted(self) -> bool:
        """Whether this rank's copy counts in global sums (norms): the first of each block's copies."""
        return self.copy_count() == 1 or dist.get_rank(self.copies) % self.copy_count() == 0

    def needs_grad_sum(self) -> bool:
        return self.partial_grad and self.copy_count() > 1

    def boxes(self, lo: int = 0, hi: int | None = None) -> list[Box]:
        """Elements ``[lo, hi)`` of the flattened local block as boxes of the full tensor."""
        hi = prod(self.shape) if hi is None else hi
        boxes = [(tuple(o + a for o, a in zip(self.offsets, off)), size)
                 for off, size in flat_range_boxes(self.shape, lo, hi)]
        if self.rows is None:
            return boxes
        out: list[Box] = []  # each box cut into runs of local rows that are consecutive full rows too
        for offsets, size in boxes:
            first = offsets[0] - self.offsets[0]
            start = first
            for row in range(first + 1, first + size[0] + 1):
                if row == first + size[0] or self.rows[row] != self.rows[row - 1] + 1:
                    out.append(((self.rows[start],) + offsets[1:], (row - start,) + size[1:]))
                    start = row
        return out


def place_rows_(tensor: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """Say which rows of the full tensor dim 0 of ``tensor``'s declared block holds now (they moved)."""
    pl = placement_of(tensor)
    if len(rows) != pl.shape[0] or not all(0 <= r < pl.full_shape[0] for r in rows):
        raise ValueError(f"rows={list(rows)}: {pl.shape[0]} indices in 0..{pl.full_shape[0] - 1} wanted")
    tensor.placement = replace(pl, rows=tuple(rows))
    return tensor


def declare_(tensor: torch.Tensor, split: dict[int, tuple[int, int]] | None = None, *,
             copies: ProcessGroup | None = None, span: int = 0, partial_grad: bool = False,
             expert: bool = False) -> torch.Tensor:
    """Attach a :class:`ParamPlacement` to ``tensor`` (a Parameter or buffer); returns it.

    ``split[d] = (index, count)``: dim ``d`` of the full tensor is cut into ``count`` equal blocks
    and this is block ``index`` (e.g. ``{0: (tp_rank, tp)}`` for a column-parallel weight)."""
    shape = tuple(tensor.shape)
    full, offsets = list(shape), [0] * len(shape)
    for d, (index, count) in (split or {}).items():
        full[d], offsets[d] = shape[d] * count, shape[d] * index
    if copies is not None and dist.get_world_size(copies) == 1:
        copies, span, partial_grad = None, 0, False
    tensor.placement = ParamPlacement(shape, tuple(full), tuple(offsets), copies, span, partial_grad, expert)
    return tensor


def declare_copies_(module: torch.nn.Module, copies: ProcessGroup | None, partial_grad: bool = False) -> torch.nn.Module:
    """Declare every parameter of ``module`` a copy on each rank of ``copies`` (e.g. a norm over TP).

    A block already declared stays that block (a TP shard copied over another group, such as the
    input embedding's vocabulary shard on the first and last pipeline stage); it can have one copies group."""
    for p in module.parameters():
        old = getattr(p, "placement", None)
        if old is not None and old.copies is not None:
            raise ValueError("a parameter already has copies over one group; it cannot be copied over a second")
        declare_(p, copies=copies, partial_grad=partial_grad, expert=old is not None and old.expert)
        if old is not None:
            p.placement = replace(p.placement, full_shape=old.full_shape, offsets=old.offsets)
    return module


def placement_of(tensor: torch.Tensor) -> ParamPlacement:
    """The declared placement, or a whole tensor held by this rank alone (besides DP replicas)."""
    pl = getattr(tensor, "placement", None)
    if pl is not None:
        return pl
    shape = tuple(tensor.shape)
    return ParamPlacement(shape, shape, (0,) * len(shape))


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Cover elements ``[lo, hi)`` of a row-major tensor of ``shape`` with at most ``2 * ndim - 1`` boxes."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner, rest, zeros = prod(shape[1:]), tuple(shape[1:]), (0,) * (len(shape) - 1)
    first, last = lo // inner, hi // inner
    out: list[Box] = []
    if lo % inner:  # a partial first row
        end = min(hi, (first + 1) * inner)
        out += [((first,) + o, (1,) + s) for o, s in flat_range_boxes(rest, lo - first * inner, end - first * inner)]
        if end == hi:
            return out
        first += 1
    if last > first:  # whole rows
        out.append(((first,) + zeros, (last - first,) + rest))
    if hi % inner:  # a partial last row
        out += [((last,) + o, (1,) + s) for o, s in flat_range_boxes(rest, 0, hi - last * inner)]
    return out


def sum_partial_grads_(items: list[tuple[torch.Tensor, ParamPlacement]]) -> int:
    """Sum, in place, each gradient share ``grad`` over its placement's copies; returns how many.

    ``grad`` may be a param's ``.grad`` or any view holding (part of) its gradient that lines up
    on every copy (e.g. a slice of a data-parallel bucket). One all-reduce per ``copies`` group:
    each block's copies write into that block's slot, so the sum only mixes ranks sharing it.
    """
    by_group: dict[ProcessGroup, list[tuple[torch.Tensor, ParamPlacement]]] = {}
    for g, pl in items:
        if pl.needs_grad_sum():
            by_group.setdefault(pl.copies, []).append((g, pl))
    for group, todo in by_group.items():
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = []
        for g, pl in todo:
            slots = torch.zeros(n // pl.copy_count(), g.numel(), dtype=g.dtype, device=g.device)
            slots[rank // pl.copy_count()] = g.reshape(-1)
            chunks.append(slots.reshape(-1))
        flat = torch.cat(chunks)
        comm.all_reduce(flat, group=group)
        offset = 0
        for g, pl in todo:
            size = (n // pl.copy_count()) * g.numel()
            g.copy_(flat[offset: offset + size].view(-1, g.numel())[rank // pl.copy_count()].view_as(g))
            offset += size
    return sum(len(v) for v in by_group.values())
