"""Expert gradients scaled to come out right under DP's mean over expert DP.

Each expert's gradient sums the contributions of every rank of its ep x etp block (disjoint
tokens); DP averages over edp replicas, but the loss is a mean over dp x cp ranks: so each is
scaled by edp / (dp * cp), by a hook on the parameter. The hook returns a scaled copy: while it
runs the gradient lives twice (sizing.activations counts both in an MoE layer's backward).
"""

from __future__ import annotations

from par_groups import placement_of


def expert_grad_scale(layout) -> float:
    """The factor expert gradients are scaled by (1: no hook)."""
    return layout.edp / (layout.dp * layout.cp)


def scale_expert_grads_(module, layout) -> None:
    """Register the scaling hook on ``module``'s expert parameters (none when the factor is 1)."""
    factor = expert_grad_scale(layout)
    if factor == 1.0:
        return
    for p in module.parameters():
        if placement_of(p).expert and p.requires_grad:
            p.register_hook(lambda g, f=factor: g * f)
