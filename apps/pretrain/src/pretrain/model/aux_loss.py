"""Route an auxiliary loss's gradient through the activations, so it works across pipeline stages.

A MoE layer's balancing loss lives on whatever stage holds the layer, while the main loss is on
the last stage. ``attach_aux_loss(x, aux, scale)`` returns ``x`` unchanged; in backward it hands
``scale`` as the gradient of ``aux``, as if ``scale * aux`` had been added to the loss.
"""

from __future__ import annotations

import torch


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: identity on x. Backward: x's grad passes through; aux gets ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    if not aux.requires_grad:
        return x
    return _AttachAuxLoss.apply(x, aux, scale)
