"""From the meta device to real storage, keeping each tensor's declared placement.

The chunks are built on the meta device (shapes and placements, no storage, no default init);
:func:`materialize_` gives every parameter and buffer uninitialised storage of its (shard) shape
on ``device``; the builder then fills the saved ones from the (seed, name) stream, piece by piece
(``ModelChunk.load_full_state_``), and each module that keeps unsaved buffers (RoPE tables, MoE
counters) computes them in ``init_buffers_(device)``. ``Module.to_empty`` would not do: it replaces the
tensors and drops the placement declared on them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class _NoNormalOnMeta(TorchFunctionMode):
    """``normal_`` (``Tensor``'s, ``nn.init``'s) on a meta tensor is a no-op here: there are no values to draw, and torch
    runs it through a decomposition that imports torch._dynamo, a slow import in every rank process."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("normal_", "trunc_normal_"):  # Tensor's, and nn.init's (tensor=)
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                return t
        return func(*args, **kwargs)


@contextmanager
def on_meta():
    """Build modules here: shapes and placements on the meta device, no storage, no init."""
    with torch.device("meta"), _NoNormalOnMeta():
        yield


def materialize_(modules: list[nn.Module], device: torch.device) -> None:
    """Give every meta tensor of ``modules`` storage on ``device``; then recompute unsaved buffers.

    A module shared by several of ``modules`` (an MTP head's embedding on a V schedule's rank) is
    handled once. Raises if an unsaved buffer has no ``init_buffers_(device)`` to compute it.
    """
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for table, wrap in ((module._parameters, True), (module._buffers, False)):
                for name, t in table.items():
                    if t is not None and t.device.type == "meta":
                        table[name] = _empty_like(t, device, wrap)
            if hasattr(module, "init_buffers_"):
                module.init_buffers_(device)
            elif any(module._buffers.get(n) is not None for n in module._non_persistent_buffers_set):
                raise TypeError(f"{type(module).__name__} keeps unsaved buffers {sorted(module._non_persistent_buffers_set)} "
                                f"but has no init_buffers_(device) to compute them after materialization")


def _empty_like(t: torch.Tensor, device: torch.device, parameter: bool) -> torch.Tensor:
    new = torch.empty(t.shape, dtype=t.dtype, device=device)
    if parameter:
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    # the declared placement (par_groups.declare_) and any other tag; not a fake tensor's own fields
    new.__dict__.update({k: v for k, v in t.__dict__.items() if k not in new.__dict__})
    return new
