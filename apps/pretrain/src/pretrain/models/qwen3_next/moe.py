"""Qwen3-Next's (and Qwen3.5-MoE's) MoE layer: par-moe's, with the shared expert's output scaled per
token by ``sigmoid(x W_g^T)`` (``shared.gate.weight [1, H]``, transformers' ``shared_expert_gate``).

Routing is par-moe's softmax top-k (renormalised over the chosen with ``norm_topk_prob``); the shared
expert is a copy over tp as in every MoE layer, and its gate goes with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from par_groups.param_placement import declare_copies_
from par_moe import MoELayer
from par_moe.experts import SwiGLU


class GatedSharedExpert(SwiGLU):
    """par-moe's shared SwiGLU times a per-token sigmoid gate."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__(hidden, ffn_hidden)
        self.gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate.weight)) * super().forward(x)  # one output row: not FP8's


class Qwen3NextMoE(MoELayer):
    def __init__(self, config, ep_group=None, etp_group=None, copies=None, partial_grad: bool = False, **kwargs) -> None:
        super().__init__(config, ep_group, etp_group, copies=copies, partial_grad=partial_grad, **kwargs)
        if not config.shared_hidden:
            raise ValueError("a Qwen3-Next MoE layer has a shared expert (num_shared_experts >= 1)")
        self.shared = declare_copies_(GatedSharedExpert(config.hidden, config.shared_hidden), copies, partial_grad)
