"""Checkpoints of the 'torch_fsdp2' strategy through the same pieces as par-zero's own strategies.

fully_shard keeps each parameter as a DTensor sharded on dim 0 (torch.chunk rows) over the inner
mesh dim, replicated over the outer one (HSDP); its optimizer state has the same layout. So the
pieces this rank owns are its local rows, at the row offset its mesh coordinate gives; a replica
describes the same box and DCP writes it once. Loading fills the local tensors in place, under
any other layout's pieces. :class:`FSDP2OptimizerState` gives the torch optimizer the checkpoint
interface of par-zero's optimizers (state kinds, scalars, state made before a load).
"""

from __future__ import annotations

import torch
from torch import nn

from .pieces import Pieces
from .torch_optimizer import scalar_state_of


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def row_offset(param: torch.Tensor) -> int:
    """The first global row of this rank's local shard of a fully_shard DTensor (0 when not sharded)."""
    spec = getattr(param, "placements", None)
    if spec is None:
        return 0
    offset, rows = 0, param.shape[0]
    for mesh_dim, placement in enumerate(spec):
        if placement.is_shard() and placement.dim == 0:
            chunk = -(-rows // param.device_mesh.size(mesh_dim))  # torch.chunk's split, as fully_shard's
            offset += chunk * param.device_mesh.get_local_rank(mesh_dim)
    return offset


def owned_local_pieces(params: dict[str, nn.Parameter], tensor_of) -> dict[nn.Parameter, Pieces]:
    """``{param: Pieces}``: the local rows of ``tensor_of(param)`` (the param, or a state of it) as one box."""
    out = {}
    for p in params.values():
        local = _local(tensor_of(p))
        offsets = (row_offset(p),) + (0,) * (p.dim() - 1)
        out[p] = Pieces(tuple(p.shape), [(offsets, local)] if local.numel() else [])
    return out


class FSDP2OptimizerState:
    """A ``torch.optim`` instance over DTensor shards, with par-zero's optimizer checkpoint interface."""

    def __init__(self, inner: torch.optim.Optimizer, params: list[nn.Parameter], step_count):
        self.inner, self.params, self.step_count = inner, params, step_count  # step_count(): the wrapper's

    def state_kinds(self) -> tuple[str, ...]:
        """Per-param state tensors shaped like the param (AdamW's moments, SGD's momentum buffer)."""
        return tuple(sorted({k for p in self.params for k, v in self.inner.state.get(p, {}).items()
                             if torch.is_tensor(v) and v.dim() > 0}))

    def scalar_state(self) -> dict[str, float]:
        return scalar_state_of(self.inner)

    def state_tensors(self) -> list[torch.Tensor]:
        return [_local(v) for p in self.params for v in self.inner.state.get(p, {}).values()
                if torch.is_tensor(v) and v.dim() > 0]

    def prepare_load(self, kinds) -> None:
        """Zeros (DTensors like each param) for the state ``kinds`` a checkpoint holds, to load into."""
        for p in self.params:
            state = self.inner.state[p]
            for kind in kinds:
                if kind not in state:
                    state[kind] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def finish_load(self, scalars: dict[str, float]) -> None:
        if isinstance(self.inner, torch.optim.AdamW) and "step" not in scalars:  # from par-zero's AdamW
            scalars = {"step": float(self.step_count())}
        for p in self.params:  # as torch keeps them: float32 scalar tensors on the CPU (not fused/capturable)
            self.inner.state[p].update({k: torch.tensor(v, dtype=torch.float32) for k, v in scalars.items()})
