"""Where each of this rank's tensors sits inside the full (Hugging-Face-named) model.

Every rank cuts its tensors out of the full state dict with ``ModelChunk.load_full_state_`` (tp
rows/columns, kv heads, vocab slices, expert and expert-ffn slices). Rather than re-deriving
that cut per layer type, we *probe* it: load synthetic full tensors whose values are the full
tensor's id, then each dimension's index, and read back which full tensor and which block every
local tensor received. So checkpoints reshard with the very code that initialises the model.

A local tensor must be one rectangular block ``full[o0:o0+s0, o1:o1+s1, ...]`` of one full
tensor (true for every layout here); anything else is a bug and raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MAX_EXACT = 2**24  # integers fp32 holds exactly: probe values must stay below


@dataclass(frozen=True)
class ShardSpec:
    """Local tensor ``local_name`` is ``full[offsets[d] : offsets[d] + sizes[d]]`` of ``full_name``."""

    local_name: str
    full_name: str
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _probe_state(shapes: dict[str, tuple[int, ...]], names: list[str], dim: int | None) -> dict[str, torch.Tensor]:
    """Full tensors as zero-copy broadcast views: the tensor id (dim None) or the index along ``dim``."""
    out = {}
    for tid, name in enumerate(names):
        shape = shapes[name]
        if dim is None:
            out[name] = torch.full((), float(tid)).expand(shape)
        elif dim < len(shape):
            view = [1] * len(shape)
            view[dim] = shape[dim]
            out[name] = torch.arange(shape[dim], dtype=torch.float32).view(view).expand(shape)
        else:
            out[name] = torch.zeros(()).expand(shape)
    return out


@torch.no_grad()
def describe_shards(module: nn.Module, chunks, full_shapes: dict[str, tuple[int, ...]]) -> dict[str, ShardSpec]:
    """``{local name in module.state_dict(): ShardSpec}`` for every floating tensor loaded from the full state.

    Call before the DP wrapper takes the params over; the tensors' values are restored afterwards.
    """
    names = sorted(full_shapes)
    assert len(names) < MAX_EXACT and all(max(s, default=0) < MAX_EXACT for s in full_shapes.values())
    local = {n: t for n, t in module.state_dict(keep_vars=True).items() if t.is_floating_point()}
    saved = {n: t.detach().clone() for n, t in local.items()}

    def load(dim):
        for t in local.values():
            t.data.fill_(float("nan"))  # untouched tensors stay NaN: not part of the full state
        probe = _probe_state(full_shapes, names, dim)
        for chunk in chunks:
            chunk.load_full_state_(probe)
        return {n: t.detach().clone() for n, t in local.items()}

    ids = load(None)
    ndim = max(len(s) for s in full_shapes.values())
    index = [load(d) for d in range(ndim)]
    specs = {}
    for n, t in ids.items():
        if torch.isnan(t).all():
            continue
        tid = int(t.reshape(-1)[0])
        if not (t == tid).all():
            raise AssertionError(f"{n}: mixes several full tensors; cannot be described as one block")
        full = names[tid]
        shape = tuple(full_shapes[full])
        if len(shape) != t.dim():
            raise AssertionError(f"{n} {tuple(t.shape)} is not a block of {full} {shape}")
        offsets = tuple(int(index[d][n].min()) if t.numel() else 0 for d in range(t.dim()))
        for d in range(t.dim()):
            view = [1] * t.dim()
            view[d] = t.shape[d]
            want = torch.arange(offsets[d], offsets[d] + t.shape[d], dtype=torch.float32).view(view).expand(t.shape)
            if not torch.equal(index[d][n], want):
                raise AssertionError(f"{n}: not a contiguous block of {full} along dim {d}")
        specs[n] = ShardSpec(n, full, shape, offsets, tuple(t.shape))
    for n, t in local.items():
        t.data.copy_(saved[n])
    return specs
