"""Multi-token prediction (DeepSeek-V3 section 2.2): ``mtp_depth`` modules after the main model.

Module k (1-based) predicts token ``t[i+k+1]`` at position i. It combines the previous depth's
hidden state (the main model's last layer output for k = 1, before the final norm) with the
embedding of ``t[i+k]``: ``h = eh_proj([enorm(emb(t[i+k])) ; hnorm(h_prev)])``, runs one decoder
block, and projects with its own norm (``shared_head.norm``) and the *shared* output head; the
embedding is shared too. Loss: ``main + mtp_loss_weight / D * sum_k L_k``, where ``L_k`` sums the
cross entropy over positions that have a target and divides by all positions (so every layout,
CP shard or micro-batch split, weighs a token alike). The logged loss is the main loss alone.

Names as the released checkpoint: module k is ``model.layers.{layers + k - 1}`` with ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and the decoder block's usual tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


IGNORE = -100


def mtp_streams(labels: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """``[tokens_1, targets_1, ..., tokens_D, targets_D]`` from next-token ``labels [..., S]``.

    ``labels[i] = t[i+1]``, so depth k reads ``t[i+k] = labels[i+k-1]`` and predicts
    ``labels[i+k]``; positions past the end get token 0 and target ``IGNORE``.
    """
    out = []
    for k in range(1, depth + 1):
        tokens = F.pad(labels[..., k - 1:], (0, k - 1), value=0)
        targets = F.pad(labels[..., k:], (0, k), value=IGNORE)
        out += [tokens, targets]
    return out


def add_mtp_parts_(layer: nn.Module, config, norm) -> nn.Module:
    """Give decoder layer ``layer`` the MTP-only tensors (HF names); ``norm()`` makes an RMSNorm."""
    layer.enorm, layer.hnorm = norm(), norm()
    layer.eh_proj = nn.Linear(2 * config.hidden, config.hidden, bias=False)
    layer.shared_head = nn.ModuleDict({"norm": norm()})
    return layer


def mtp_gather_units(layer: nn.Module) -> list[nn.Module]:
    """The modules ZeRO-3 gathers for an MTP layer: :func:`mtp_loss` calls its parts one by one,
    so each is a unit of its own, and the layer itself (its decoder block) takes what is left."""
    return [layer.enorm, layer.hnorm, layer.eh_proj, layer.shared_head["norm"], layer]


def mtp_loss(config, hidden: torch.Tensor, streams: list[torch.Tensor], layers, embed, run_block, project, cross_entropy):
    """``mtp_loss_weight / D * sum_k L_k`` (see the module docstring).

    ``embed(tokens)`` and ``project(x)`` are the shared embedding and output head (as the caller
    lays them out), ``layers`` the MTP decoder layers, ``run_block(layer, x)`` runs one's block,
    ``cross_entropy(logits, targets)`` sums the token losses.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for k, layer in enumerate(layers):
        tokens, targets = streams[2 * k], streams[2 * k + 1]
        hidden = layer.eh_proj(torch.cat([layer.enorm(embed(tokens)), layer.hnorm(hidden)], dim=-1))
        hidden = run_block(layer, hidden)
        total = total + cross_entropy(project(layer.shared_head["norm"](hidden)), targets) / targets.numel()
    return total * (config.mtp_loss_weight / config.mtp_depth)
