"""For tests only (not exported from ``par_moe``): ReferenceMoE, the single-device MoE layer, written
plainly and independently of the fast path.

It loops over experts, applies capacity with a per-expert sort, and spells out each loss. It has
the parameter layout of :class:`MoELayer` with every expert and the full F (``router.weight
[E, H]``, ``router.expert_bias [E]``, ``experts.w_gate/w_up [E, F, H]``, ``experts.w_down
[E, H, F]``, ``shared.*``), so ``MoELayer.from_reference`` gives any EP/ETP layout the same model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


class _Params(nn.Module):
    pass


class ReferenceMoE(nn.Module):
    """``forward(x) -> (y, aux_loss)`` for ``x [T, H]`` or ``[S, B, H]`` on one device."""

    def __init__(self, config: MoEConfig, seed: int = 0):
        super().__init__()
        self.config = config
        c = config
        gen = torch.Generator().manual_seed(seed)

        def normal(*shape, fan_in):
            return nn.Parameter(torch.randn(*shape, generator=gen) * fan_in ** -0.5)

        self.router = _Params()
        self.router.weight = normal(c.num_experts, c.hidden, fan_in=c.hidden)
        self.router.register_buffer("expert_bias", torch.zeros(c.num_experts))
        self.experts = _Params()
        self.experts.w_gate = normal(c.num_experts, c.ffn_hidden, c.hidden, fan_in=c.hidden)
        self.experts.w_up = normal(c.num_experts, c.ffn_hidden, c.hidden, fan_in=c.hidden)
        self.experts.w_down = normal(c.num_experts, c.hidden, c.ffn_hidden, fan_in=c.ffn_hidden)
        self.shared = None
        if c.shared_hidden:
            self.shared = _Params()
            self.shared.w_gate = normal(c.shared_hidden, c.hidden, fan_in=c.hidden)
            self.shared.w_up = normal(c.shared_hidden, c.hidden, fan_in=c.hidden)
            self.shared.w_down = normal(c.hidden, c.shared_hidden, fan_in=c.shared_hidden)

    def route(self, tokens: torch.Tensor):
        """(logits, scores, chosen experts [T, k], their weights [T, k])."""
        c = self.config
        logits = tokens.float() @ self.router.weight.float().T
        scores = torch.softmax(logits, -1) if c.score_func == "softmax" else torch.sigmoid(logits)
        select = scores.detach() + self.router.expert_bias
        if c.n_groups > 1:
            size = c.num_experts // c.n_groups
            per_group = select.view(-1, c.n_groups, size).sort(-1, descending=True).values
            summed = min(2, size) if c.group_score == "top2" else c.top_k // c.topk_groups
            group_score = per_group[..., :summed].sum(-1)
            best_groups = group_score.argsort(-1, descending=True)[:, : c.topk_groups]
            allowed = torch.zeros_like(select, dtype=torch.bool)
            for g in range(c.n_groups):
                chosen = (best_groups == g).any(-1, keepdim=True)
                allowed[:, g * size:(g + 1) * size] = chosen
            select = torch.where(allowed, select, torch.full_like(select, float("-inf")))
        chosen = select.argsort(dim=-1, descending=True, stable=True)[:, : c.top_k]  # ties: the lower expert index
        weights = scores.gather(1, chosen)
        if c.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, chosen, weights * c.routed_scaling_factor

    def capacity_keep(self, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Per expert: keep the first (position) or heaviest (probs) ``capacity`` of its pairs."""
        c = self.config
        keep = torch.ones_like(chosen, dtype=torch.bool)
        if c.capacity_factor is None:
            return keep
        capacity = math.ceil(c.capacity_factor * chosen.shape[0] * c.top_k / c.num_experts)  # the formula, not MoEConfig's
        for e in range(c.num_experts):
            tok, slot = (chosen == e).nonzero(as_tuple=True)  # row-major: token order
            if len(tok) <= capacity:
                continue
            if c.drop_policy == "probs":
                order = weights.detach()[tok, slot].argsort(descending=True)
                tok, slot = tok[order], slot[order]
            keep[tok[capacity:], slot[capacity:]] = False
        return keep

    def forward(self, x: torch.Tensor):
        c = self.config
        tokens = x.reshape(-1, c.hidden)
        logits, scores, chosen, weights = self.route(tokens)
        keep = self.capacity_keep(chosen, weights)
        y = torch.zeros_like(tokens)
        for e in range(c.num_experts):
            tok, slot = ((chosen == e) & keep).nonzero(as_tuple=True)
            out = swiglu(tokens[tok], self.experts.w_gate[e], self.experts.w_up[e], self.experts.w_down[e])
            y = y.index_add(0, tok, out * weights[tok, slot].unsqueeze(-1).to(out.dtype))
        if self.shared is not None:
            y = y + swiglu(tokens, self.shared.w_gate, self.shared.w_up, self.shared.w_down)
        return y.reshape(x.shape), self.balance_loss(logits, scores, chosen, x.shape)

    def balance_loss(self, logits, scores, chosen, shape):
        c = self.config
        E, k = c.num_experts, c.top_k
        probs = scores if c.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        one_hot = F.one_hot(chosen, E).sum(1).float()  # [T, E] pairs per token per expert
        total = logits.new_zeros(())
        if c.aux_loss_coeff:
            f = one_hot.mean(0) / k
            total = total + c.aux_loss_coeff * E * (f * probs.mean(0)).sum()
        if c.seq_aux_loss_coeff:
            batch = shape[1] if len(shape) == 3 else 1
            per_seq = []
            for b in range(batch):
                f = one_hot[b::batch].mean(0) * E / k  # sequence b's tokens (rows b, b + batch, ...)
                per_seq.append((f * probs[b::batch].mean(0)).sum())
            total = total + c.seq_aux_loss_coeff * torch.stack(per_seq).mean()
        if c.z_loss_coeff:
            total = total + c.z_loss_coeff * torch.logsumexp(logits, -1).pow(2).mean()
        return total
