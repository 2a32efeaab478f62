"""The router: scores every expert for every token and picks each token's top-k experts.

DeepSeek-V3 style when ``score_func="sigmoid"``: the expert bias (aux-loss-free balancing) only
shifts which experts are *selected*; the combine weights are the unbiased scores of the chosen
experts, normalized to sum to one and multiplied by ``routed_scaling_factor``. Group-limited
routing first keeps each token's best ``topk_groups`` expert groups, so a token reaches at most that
many groups. A group's score (``group_score``) is the sum of its top 2 selection scores ("top2", as
DeepSeek-V3's released code and transformers), or of its top ``top_k / topk_groups``
("top_k_per_group", the node score of the DeepSeek-V3 paper's node-limited routing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig


@dataclass
class Routing:
    """One routing decision for ``T`` tokens (fp32). ``weights`` carries the router's gradient."""

    logits: torch.Tensor  # [T, E]
    scores: torch.Tensor  # [T, E] softmax or sigmoid of logits
    indices: torch.Tensor  # [T, k] chosen experts (int64)
    weights: torch.Tensor  # [T, k] combine weights of the chosen experts
    keep: torch.Tensor | None = None  # [T, k] False where capacity dropped the pair; None: dropless


def group_limited_mask(select: torch.Tensor, n_groups: int, topk_groups: int, top_k: int,
                       group_score: str = "top2") -> torch.Tensor:
    """[T, E] bool: True for the experts of each token's best ``topk_groups`` groups."""
    tokens, experts = select.shape
    grouped = select.view(tokens, n_groups, experts // n_groups)
    summed = min(2, grouped.shape[-1]) if group_score == "top2" else top_k // topk_groups
    group_scores = grouped.topk(summed, dim=-1).values.sum(-1)  # [T, n_groups]
    best = group_scores.topk(topk_groups, dim=-1).indices
    keep_group = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep_group.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)


class Router(nn.Module):
    """Linear scoring ``weight [E, H]`` plus a selection-only ``expert_bias [E]`` buffer (fp32)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        nn.init.normal_(self.weight, std=config.hidden ** -0.5)

    def forward(self, x: torch.Tensor, indices: torch.Tensor | None = None) -> Routing:
        """``x [T, H]`` -> routing of every token (computed in fp32 for stable top-k). ``indices``: the
        experts already chosen (a recomputed forward replaying its first run: ``replay``)."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if c.score_func == "softmax" else logits.sigmoid()
        if indices is None:
            indices = self.select(scores)
        weights = scores.gather(1, indices)
        if c.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(logits, scores, indices, weights * c.routed_scaling_factor)

    @torch.no_grad()
    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Each token's top-k experts ``[T, k]`` by its biased (and group-limited) scores."""
        c = self.config
        select = scores + self.expert_bias
        if c.n_groups > 1:
            allowed = group_limited_mask(select, c.n_groups, c.topk_groups, c.top_k, c.group_score)
            select = select.masked_fill(~allowed, float("-inf"))
        # a stable sort, not topk: tied scores go to the lower expert index on every layout and device; the
        # top k copied out, so the [T, E] order is freed (a view would keep it as long as the routing is kept)
        return select.sort(dim=-1, descending=True, stable=True).indices[:, : c.top_k].contiguous()


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, slot) pairs chose each expert: int64 [E]."""
    return torch.bincount(indices.reshape(-1), minlength=num_experts)
