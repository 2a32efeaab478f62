"""AdamW on flat fp32 shards, the same arithmetic as torch.optim.AdamW (foreach=False).

On CUDA the update is torch's fused AdamW kernel (one launch instead of ~10 elementwise ones,
what ``torch.optim.AdamW(fused=True)`` runs); elsewhere the explicit ops below, so CPU results
are those of ``foreach=False``.
"""

from __future__ import annotations

import math

import torch


def fused_adamw_available(param: torch.Tensor) -> bool:
    return param.is_cuda and hasattr(torch, "_fused_adamw_")


@torch.no_grad()
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                fused: bool | None = None, step_tensor: torch.Tensor | None = None) -> None:
    """One decoupled-weight-decay Adam update of ``param`` in place (all fp32, same shape).

    ``fused``: None = torch's fused kernel on CUDA; True/False force it on or off. ``step_tensor``: the
    fused kernel's step count, a 0-d fp32 tensor on the param's device holding ``step`` (the caller's,
    kept across steps); without it one is made here."""
    beta1, beta2 = betas
    if fused if fused is not None else fused_adamw_available(param):
        fused_adamw_step_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps,
                          weight_decay=weight_decay, step_tensor=step_tensor)
        return
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = exp_avg_sq.sqrt().div_(math.sqrt(bias_correction2)).add_(eps)  # one temporary, same arithmetic
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def fused_adamw_step_(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, betas, eps: float,
                      weight_decay: float, step_tensor: torch.Tensor | None = None) -> None:
    """torch's fused AdamW kernel on one tensor (the step count lives on the param's device: ``step_tensor``
    or made by a fill there, not copied from the host, which on CUDA would wait for the stream)."""
    if step_tensor is None:
        step_tensor = torch.full((), float(step), dtype=torch.float32, device=param.device)
    steps = [step_tensor]
    torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], steps, lr=lr, beta1=betas[0], beta2=betas[1],
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) as a tensor on the norm's device: no host sync on a GPU.

    Computed in fp64 like the Python float it replaces, so the grads (multiplied by it even when
    it is 1, which is exact) come out bitwise as before on the CPU; a NaN norm leaves them as they are."""
    return (max_norm / (norm.double() + 1e-6)).clamp(max=1.0).nan_to_num(nan=1.0)
