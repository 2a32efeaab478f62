"""Naive single-device attention over the full sequence, the reference the tests compare with.

Dense scores, explicit mask, float64, written independently of the kernels: it shares no code
with them so it can catch their mistakes.
"""

from __future__ import annotations

import torch


def reference_attention(q, k, v, causal: bool = True, cu_seqlens=None, scale: float | None = None) -> torch.Tensor:
    """q [S, B, Hq, D], k/v [S, B, Hkv, D] (full sequence) -> [S, B, Hq, D], in float64."""
    s, _, hq, d = q.shape
    g = hq // k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qd = q.double().permute(1, 2, 0, 3)
    kd = k.double().permute(1, 2, 0, 3).repeat_interleave(g, dim=1)
    vd = v.double().permute(1, 2, 0, 3).repeat_interleave(g, dim=1)
    allowed = torch.ones(s, s, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed)
    if cu_seqlens is not None:
        doc = torch.zeros(s, dtype=torch.long, device=q.device)
        for start in list(cu_seqlens)[1:-1]:
            doc[int(start):] += 1
        allowed = allowed & (doc[:, None] == doc[None, :])
    scores = (qd @ kd.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees nothing outputs 0
    return (probs @ vd).permute(2, 0, 1, 3)
