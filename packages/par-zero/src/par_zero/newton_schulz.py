"""Muon's orthogonalization and learning-rate scale, the same arithmetic as ``torch.optim.Muon``.

``zeropower_via_newtonschulz`` is torch's ``_zeropower_via_newtonschulz`` (the quintic iteration of
Keller Jordan's Muon, torch's coefficients) with the working dtype an argument: torch's is bf16
(``ns_dtype=torch.bfloat16`` gives its results bit for bit), fp32 is the one whose results do not
depend on how the gradient was summed beyond fp32 rounding (what the same-math tests compare).
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
NS_EPS = 1e-7
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")  # torch.optim.Muon's adjust_lr_fn


def zeropower_via_newtonschulz(grad: torch.Tensor, ns_steps: int, ns_dtype: torch.dtype = torch.bfloat16,
                               coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                               eps: float = NS_EPS) -> torch.Tensor:
    """The (approximate) orthogonal factor of the 2-D ``grad``, in ``ns_dtype``."""
    if grad.dim() != 2:
        raise ValueError(f"Newton-Schulz takes a matrix, got shape {list(grad.shape)}")
    a, b, c = coefficients
    x = grad.to(dtype=ns_dtype, copy=True)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def ns_flops(shape: tuple[int, ...], ns_steps: int) -> int:
    """Newton-Schulz FLOPs of one ``shape[-2:]`` matrix (m = the short side, n = the long side): per
    iteration the three matmuls of :func:`zeropower_via_newtonschulz`, ``X X^T`` (2 m^2 n),
    ``gram gram`` (2 m^3) and ``gram_update X`` (2 m^2 n), so ``ns_steps * (4 m^2 n + 2 m^3)``
    (the elementwise terms and the normalization, O(m n), are left out)."""
    m, n = sorted(shape[-2:])
    return ns_steps * (4 * m * m * n + 2 * m ** 3)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, int]) -> float:
    """torch.optim.Muon's learning rate for a ``shape`` (fan-out, fan-in) matrix."""
    a, b = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, a / b))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(a, b))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = math.sqrt(a / b)
    else:
        raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} is not one of {', '.join(ADJUST_LR_FNS)}")
    return lr * ratio
