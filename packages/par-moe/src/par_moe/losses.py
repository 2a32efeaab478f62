"""Load-balancing losses of the router, each as this rank's share of a group's loss.

With ``counts`` and ``total`` summed over the ranks that split the same tokens (the aux group),
each rank's share only needs its local scores, and the shares summed over the group equal the
loss over all the group's tokens, gradients included, with no differentiable collective.

* Switch/GShard: ``coeff * E * sum_i f_i * P_i`` with ``f_i = count_i / (k T)`` and
  ``P_i = mean_t p_ti`` (softmax probabilities, or sigmoid scores normalized per token).
* Sequence-wise (DeepSeek-V3): the same per sequence, averaged over the sequences.
* z-loss: ``coeff * mean_t logsumexp(logits_t)^2``.
"""

from __future__ import annotations

import torch


def scores_for_aux(scores: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-token distributions over experts the balance losses use."""
    if score_func == "softmax":
        return scores
    return scores / (scores.sum(-1, keepdim=True) + 1e-20)


def switch_aux_loss(probs: torch.Tensor, counts: torch.Tensor, total_tokens: int, top_k: int, coeff: float) -> torch.Tensor:
    """probs [T, E] local; counts [E] over the group; total_tokens over the group."""
    num_experts = probs.shape[-1]
    f = counts.to(probs.dtype) / (top_k * total_tokens)
    return coeff * num_experts * (f * probs.sum(0)).sum() / total_tokens


def sequence_aux_loss(probs: torch.Tensor, counts: torch.Tensor, seq_len: int, top_k: int, coeff: float) -> torch.Tensor:
    """probs [S, B, E] local; counts [B, E] per sequence over the group; seq_len S over the group."""
    num_experts = probs.shape[-1]
    f = counts.to(probs.dtype) / (top_k * seq_len)
    per_sequence = num_experts * (f * probs.sum(0)).sum(-1) / seq_len  # [B]
    return coeff * per_sequence.mean()


def z_loss(logits: torch.Tensor, total_tokens: int, coeff: float) -> torch.Tensor:
    return coeff * torch.logsumexp(logits, dim=-1).square().sum() / total_tokens


def sequence_counts(indices: torch.Tensor, batch: int, num_experts: int) -> torch.Tensor:
    """indices [S*B, k] of tokens laid out [S, B] -> [B, E] pairs per sequence per expert."""
    seq_of_pair = (torch.arange(indices.shape[0], device=indices.device) % batch).repeat_interleave(indices.shape[1])
    flat = seq_of_pair * num_experts + indices.reshape(-1)
    return torch.bincount(flat, minlength=batch * num_experts).view(batch, num_experts)
