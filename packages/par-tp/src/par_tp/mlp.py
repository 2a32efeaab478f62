"""Tensor-parallel SwiGLU MLP: gate and up column-parallel, down row-parallel, one reduction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from .comm import enter_tensor_parallel_region
from .layers import ColumnParallelLinear, RowParallelLinear
from .overlap import all_gather_matmul


class TPSwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the ffn dimension split over TP ranks.

    Input/output ``[S, B, hidden]``, or ``[S/tp, B, hidden]`` with ``sequence_parallel``.
    Communication per call: forward one all-reduce (or all-gather + reduce-scatter with SP), and
    the dual in backward; gate and up share the single entry collective.
    Full layout (Llama/HF): ``w_gate [ffn, hidden]``, ``w_up [ffn, hidden]``, ``w_down [hidden, ffn]``.
    """

    def __init__(self, hidden: int, ffn_hidden: int, tp_group: ProcessGroup, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None, comm_overlap: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        kw = dict(dtype=dtype, device=device, comm_overlap=comm_overlap)
        self.gate = ColumnParallelLinear(hidden, ffn_hidden, tp_group, sequence_parallel=sequence_parallel, **kw)
        self.up = ColumnParallelLinear(hidden, ffn_hidden, tp_group, sequence_parallel=sequence_parallel, **kw)
        self.down = RowParallelLinear(ffn_hidden, hidden, tp_group, input_is_parallel=True, sequence_parallel=sequence_parallel, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)
        return self.down(F.silu(gate) * up)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's gate and up ``[S, B, ffn/tp]``: the one entry collective, then the local matmuls.
        A backend may replace it on an instance (pretrain's TE backend moves the input norm in here)."""
        if self.gate.comm_overlap:  # gate and up share one overlapped gather
            gate, up = all_gather_matmul(x, [self.gate.weight, self.up.weight], self.tp_group, [self.gate.bias, self.up.bias])
            return gate, up
        x = enter_tensor_parallel_region(x, self.tp_group, self.sequence_parallel)
        return self.gate.forward_local(x), self.up.forward_local(x)

    @torch.no_grad()
    def load_full_(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> "TPSwiGLU":
        self.gate.load_full_(w_gate)
        self.up.load_full_(w_up)
        self.down.load_full_(w_down)
        return self

    def full_weights(self) -> dict[str, torch.Tensor]:
        """``{"w_gate", "w_up", "w_down"}`` gathered from every rank (collective)."""
        return {"w_gate": self.gate.full_weight(), "w_up": self.up.full_weight(), "w_down": self.down.full_weight()}
