"""From the meta device to real storage, keeping each tensor's declared placement.

The chunks are built on the meta device (shapes and placements, no storage, no default init);
:func:`materialize_` gives every parameter and buffer uninitialised storage of its (shard) shape
on ``device``; the builder then fills the saved ones from the (seed, name) stream, piece by piece
(``ModelChunk.load_full_state_``), and each module that keeps unsaved buffers (RoPE tables, MoE
counters) recomputes them in ``init_buffers_``. ``Module.to_empty`` would not do: it replaces the
tensors and drops the placement declared on them.
"""

from __future__ import annotations

import torch
from torch import nn


def materialize_(modules: list[nn.Module], device: torch.device) -> None:
    """Give every meta tensor of ``modules`` storage on ``device``; then recompute unsaved buffers.

    A module shared by several of ``modules`` (an MTP head's embedding on a V schedule's rank) is
    handled once. Raises if an unsaved buffer has no ``init_buffers_`` to compute it.
    """
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            unsaved = [n for n, b in module._buffers.items() if b is not None and n in module._non_persistent_buffers_set]
            for table, wrap in ((module._parameters, True), (module._buffers, False)):
                for name, t in table.items():
                    if t is not None and t.device.type == "meta":
                        table[name] = _empty_like(t, device, wrap)
            if unsaved:
                if not hasattr(module, "init_buffers_"):
                    raise TypeError(f"{type(module).__name__} keeps unsaved buffers {unsaved} but has no "
                                    f"init_buffers_() to compute them after materialization")
                module.init_buffers_()


def _empty_like(t: torch.Tensor, device: torch.device, parameter: bool) -> torch.Tensor:
    new = torch.empty(t.shape, dtype=t.dtype, device=device)
    if parameter:
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    # the declared placement (par_groups.declare_) and any other tag; not a fake tensor's own fields
    new.__dict__.update({k: v for k, v in t.__dict__.items() if k not in new.__dict__})
    return new
