"""What each rank saves of its parameters and optimizer state: the pieces it owns, in global coordinates.

A trainable param's master copy and optimizer state (AdamW's moments, a torch.optim class's
per-param tensors) live, on this rank, in the optimizer range of
its bucket: a contiguous slice of the flattened local (TP/expert) block. Its placement turns that
slice into boxes of the full tensor (``ParamPlacement.boxes``), each a view of the buffer: no
gather, no copy. Replicas (DDP, HSDP outer 'no_shard', TP copies) describe the same boxes and are
written once; loading under another DP size, strategy or model-parallel split reads the stored
chunks overlapping the boxes this rank owns, straight into its buffers, then re-assembles the
params. Frozen params are saved whole (their placement's block).
"""

from __future__ import annotations

from math import prod
from typing import Iterable

import torch
from torch import nn

from par_groups import comm
from par_groups.param_placement import placement_of

from .pieces import Pieces

def owned_pieces(dp, kind: str = "master") -> dict[nn.Parameter, Pieces]:
    """``{param: Pieces}`` of ``kind`` ('master' or one of ``dp.optimizer.state_kinds()``) for every trainable param."""
    return _range_pieces(dp.buckets, dp.optimizer, kind)


def buddy_pieces(dp, kind: str = "master") -> dict[nn.Parameter, Pieces]:
    """As :func:`owned_pieces`, of the buddy ranges (buddy.py) this rank steps beside its own (empty without them)."""
    if dp.buddy_optimizer is None:
        return {}
    return _range_pieces(dp.buffer.buddies, dp.buddy_optimizer, kind)


def _range_pieces(ranges, optimizer, kind: str) -> dict[nn.Parameter, Pieces]:
    kinds = ("master",) + optimizer.state_kinds()
    if kind not in kinds:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(kinds)}")
    out = {}
    for b in ranges:
        src = optimizer.range_state(b, kind)
        for p in b.params:
            out[p] = Pieces(placement_of(p).full_shape)
        for p, _, lo, hi, p_lo in b.opt_segments():
            start = lo
            for offsets, size in placement_of(p).boxes(p_lo, p_lo + hi - lo):
                n = prod(size)
                out[p].boxes.append((offsets, src[start: start + n].view(size)))
                start += n
    return out


def whole_pieces(tensor: torch.Tensor) -> Pieces:
    """A tensor this rank holds entirely (a frozen param, a buffer) as the block its placement names."""
    pl = placement_of(tensor)
    return Pieces(pl.full_shape, [(pl.offsets, tensor.detach())])


def _scalar(x: float, dtype: torch.dtype = torch.float64) -> Pieces:
    return Pieces((), [((), torch.tensor(float(x), dtype=dtype))])


def sharded_state_dict(dp, kinds: Iterable[str] | None = None, scalars: Iterable[str] = ()) -> dict[str, Pieces]:
    """``model/<name>``, ``optim/<kind>/<name>``, ``optim/scalar/<name>`` and ``optim/step`` for
    :func:`par_zero.save_pieces`; ``kinds`` and ``scalars`` (for a load): zeros for the optimizer to fill."""
    opt = dp.optimizer
    if kinds is not None:
        opt.prepare_load(tuple(kinds))
    names = dp.param_names
    out = {f"model/{names[p]}": v for p, v in owned_pieces(dp, "master").items()}
    for kind in opt.state_kinds():
        out |= {f"optim/{kind}/{names[p]}": v for p, v in owned_pieces(dp, kind).items()}
    for name, p in dp.module.named_parameters():
        if not p.requires_grad:
            out[f"model/{name}"] = whole_pieces(p)
    have = opt.scalar_state() if kinds is None else dict.fromkeys(scalars, 0.0)
    out |= {f"optim/scalar/{k}": _scalar(v) for k, v in have.items()}
    out["optim/step"] = _scalar(dp.step_count, torch.float32)
    return out


@torch.no_grad()
def load_sharded_state_dict(dp, sd: dict[str, Pieces]) -> None:
    """After :func:`par_zero.load_pieces` filled ``sd`` (our :func:`sharded_state_dict`, whose boxes
    are views of the buffers): take the step and scalars, and re-assemble the params from the owned ranges."""
    value = lambda k: sd[k].boxes[0][1].item()
    dp.step_count = int(value("optim/step"))
    dp.optimizer.finish_load({k.removeprefix("optim/scalar/"): value(k) for k in sd if k.startswith("optim/scalar/")})
    dp.sync_params()


@torch.no_grad()
def gather_full_state(dp, kind: str = "master") -> dict[str, torch.Tensor]:
    """``kind`` of every trainable param, full size on every rank (for tests and export): each
    rank's optimizer range summed into zeros over the ranks holding the other ranges."""
    out = {}
    for b in dp.buckets:
        flat = torch.zeros(b.N, dtype=torch.float32, device=b.device)
        flat[b.opt_lo : b.opt_hi] = dp.optimizer.range_state(b, kind)
        if dp.cfg.shard_optimizer:
            # opt ranges are disjoint within the inner group (x outer for outer 'optim')
            comm.all_reduce(flat, b.groups.inner)
            if b.outer_optim:
                comm.all_reduce(flat, b.groups.outer)
        for p, o in zip(b.params, b.offsets):
            out[dp.param_names[p]] = flat[o : o + p.numel()].view(p.shape).clone()
    return out
