"""gpt-oss's MoE layer: par-moe's, with a router bias and experts that have biases and a clamped SwiGLU.

Router: ``logits = x W^T + b``; a token's top-k experts weighted by the softmax of their logits (par-moe's
softmax scores renormalized over the chosen: the same). Expert: ``gate, up = x W_g^T + b_g, x W_u^T + b_u``,
``gate`` clamped above and ``up`` on both sides at ``LIMIT``, ``(up + 1) * gate * sigmoid(ALPHA * gate)``,
then ``W_d`` and ``b_d`` (before the routing weight, as in transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from par_groups.param_placement import declare_, declare_copies_
from par_moe import MoELayer
from par_moe.experts import GroupedSwiGLU, GroupLayout, _autocast_operands, grouped_linear, grouped_mm_supported
from par_moe.router import Router, Routing

ALPHA, LIMIT = 1.702, 7.0


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


class BiasedRouter(Router):
    """par-moe's router with a learned bias on the logits (``bias [E]``; the ``expert_bias`` buffer still
    only shifts the selection)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor, indices: torch.Tensor | None = None) -> Routing:
        """As :meth:`Router.forward` (``indices``: a recomputed forward's replayed choice)."""
        logits = F.linear(x.float(), self.weight.float(), self.bias.float())
        scores = logits.softmax(-1)
        if indices is None:
            indices = self.select(scores.detach())
        weights = scores.gather(1, indices)
        return Routing(logits, scores, indices, weights / weights.sum(-1, keepdim=True))


class BiasedClampedExperts(GroupedSwiGLU):
    """``GroupedSwiGLU``'s weights plus ``b_gate``, ``b_up [E, F]`` and ``b_down [E, H]``."""

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, block) -> None:
        super().__init__(num_experts, hidden, ffn_hidden, block)
        experts, ffn = block
        self.b_gate = declare_(nn.Parameter(torch.zeros(num_experts, ffn_hidden)), {0: experts, 1: ffn}, expert=True)
        self.b_up = declare_(nn.Parameter(torch.zeros(num_experts, ffn_hidden)), {0: experts, 1: ffn}, expert=True)
        self.b_down = declare_(nn.Parameter(torch.zeros(num_experts, hidden)), {0: experts}, expert=True)

    def forward(self, tokens, counts, max_count=None, replicas=None, segments=None):
        """As :meth:`GroupedSwiGLU.forward` (no replicas: gpt-oss runs ``expert_balance = "none"``); with
        ``grouped_kernels`` (FP8) each projection is its kernel, each source rank's rows quantized apart;
        ``recompute_act``: the clamped SwiGLU rerun in the backward."""
        layout = GroupLayout(counts.to(tokens.device), tokens.shape[0], max_count)
        params = (self.w_gate, self.w_up, self.w_down, self.b_gate, self.b_up, self.b_down)
        if tokens.shape[0] == 0:  # every parameter in the graph, so its (zero) gradient exists on every rank
            return tokens + 0 * sum(p.sum() for p in params).to(tokens.dtype)
        row = layout.group_of_row
        if self.grouped_kernels is not None:
            seg = layout.counts.unsqueeze(1) if segments is None else segments
            weights, biases = params[:3], params[3:]

            def linear(i, x):
                return self.grouped_kernels[i](x, weights[i], seg) + biases[i][row].to(x.dtype)
        else:
            tokens, *cast = _autocast_operands(tokens, *params)
            weights, biases = cast[:3], cast[3:]
            fast = grouped_mm_supported(tokens, *weights)

            def linear(i, x):
                return grouped_linear(x, weights[i], layout, fast) + biases[i][row]
        gate, up = linear(0, tokens), linear(1, tokens)
        if self.recompute_act and torch.is_grad_enabled():  # [model].recompute's moe_act: gate and up kept
            return linear(2, checkpoint(clamped_swiglu, gate, up, use_reentrant=False))
        return linear(2, clamped_swiglu(gate, up))


class GptOssMoE(MoELayer):
    def __init__(self, config, ep_group=None, etp_group=None, copies=None, partial_grad: bool = False, **kwargs) -> None:
        super().__init__(config, ep_group, etp_group, copies=copies, partial_grad=partial_grad, **kwargs)
        if self.etp > 1:
            raise ValueError("gpt-oss experts run with expert tensor parallelism 1 (their down bias is not split)")
        self.router = declare_copies_(BiasedRouter(config), copies, partial_grad)
        block = ((self.first_expert // self.num_local_experts, self.ep), (0, 1))
        self.experts = BiasedClampedExperts(self.num_local_experts, config.hidden, self.ffn_shard, block)
