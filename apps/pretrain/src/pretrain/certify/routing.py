"""MoE routing, counted on both sides: a near-tie flip is reported, any other difference names its layer.

Top-k routing is discrete: a token whose k-th and (k+1)-th best experts are nearly tied goes to one
or the other depending on the last bit of its scores, which another layout's sums (or another CPU's
kernels) round differently. Such a flip moves that step's outputs and gradients by far more than
rounding, so it cannot be judged at the fp64 band; a wrong layout that sends tokens to other experts
must still fail. The rule is the suite's (``tests/moe_stepwise.py``):

- every MoE layer's routed (token, expert) pairs per expert are counted each step, on the reference
  (one rank: the whole batch) and on the layout (summed over its ranks: each routes its own tokens,
  its dp x cp x tp share, with or without sequence parallelism, so a token routed twice shows);
  the smallest top-k margin of the reference's selection scores per layer;
- equal counts: the step is compared as any other;
- different counts pass only as a near-tie flip: at most MAX_MOVED_PAIRS pairs moved over all
  layers, the reference's smallest top-k margin in the first layer that differs (forward order)
  within ROUTING_NOISE, and the loss within FLIPPED_LOSS_TOLERANCE. The step is then reported and
  compared at the band only up to that layer (outputs before its router); its later outputs, its
  gradients and its grad norm are not.
- otherwise the step is NOT certified at that MoE layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from par_groups import comm

# The suite's numbers (tests/moe_stepwise.py): a near-tie flip moves one (token, expert) pair, or a few;
# the largest top-k margin rounding can cross is 10x fp32's resolution at 1; one of a few hundred
# tokens sent to its second-best expert moves the mean loss by ~1e-6 at most.
MAX_MOVED_PAIRS = 2
ROUTING_NOISE = 1e-6
FLIPPED_LOSS_TOLERANCE = 1e-4


def is_router(module) -> bool:
    try:
        from par_moe.router import Router
    except ImportError:  # pragma: no cover - par-moe is a dependency of pretrain
        return False
    return isinstance(module, Router)


def routed_pairs(indices: torch.Tensor, num_experts: int) -> list[int]:
    """Routed (token, slot) pairs per expert."""
    return indices.reshape(-1).bincount(minlength=num_experts).tolist()


def smallest_margin(scores: torch.Tensor, expert_bias: torch.Tensor, top_k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th selection score (scores + bias), as the
    suite measures it; inf with no token or with top_k = num_experts (nothing to flip to)."""
    select = (scores.detach().float() + expert_bias.float()).sort(dim=-1, descending=True).values
    if select.shape[0] == 0 or select.shape[1] <= top_k:
        return float("inf")
    return float((select[:, top_k - 1] - select[:, top_k]).min())


def gather_routing(local: dict[str, list[int]], counts_here: bool) -> dict[str, list[int]]:
    """The layout's routed pairs per expert per layer over the world: each rank's own counts where
    ``counts_here`` (its tokens are its own), summed per layer (a pipeline stage holds some layers)."""
    every = [None] * dist.get_world_size()
    comm.all_gather_object(every, local if counts_here else {}, None)
    out: dict[str, list[int]] = {}
    for d in every:
        for name, load in d.items():
            out[name] = [a + b for a, b in zip(out.get(name, [0] * len(load)), load)]
    return out


def compare_routing(got: dict[str, list[int]], ref: dict[str, list[int]], ref_margins: dict[str, float],
                    order: list[str], loss_error: float) -> dict | None:
    """None when every layer routed the same pairs per expert as the reference; else what differs:
    the first router that differs (in ``order``, forward order), the pairs moved over all layers, the
    reference's smallest margin there, and whether it passes as a near-tie flip (see the module doc)."""
    layers = sorted(set(got) | set(ref), key=lambda n: order.index(n) if n in order else len(order))
    differ, moved = [], 0
    for name in layers:
        a, b = got.get(name), ref.get(name)
        if a is None or b is None or len(a) != len(b):
            differ.append(name)
            moved += sum(a or []) + sum(b or [])  # a layer routed on one side only: no tie explains it
            continue
        m = sum(abs(x - y) for x, y in zip(a, b))
        if m:
            differ.append(name)
            moved += m
    if not differ:
        return None
    moved = -(-moved // 2)  # a pair that moved leaves one expert and reaches another
    first = differ[0]
    margin = ref_margins.get(first, float("inf"))
    near_tie = moved <= MAX_MOVED_PAIRS and margin <= ROUTING_NOISE and loss_error <= FLIPPED_LOSS_TOLERANCE
    if moved > MAX_MOVED_PAIRS:
        why = f"{moved} pairs moved; a near-tie flip moves at most {MAX_MOVED_PAIRS}"
    elif margin > ROUTING_NOISE:
        why = (f"{moved} pair(s) moved, but the reference's smallest top-k margin there is {margin:.1e}: "
               f"no near-tie (<= {ROUTING_NOISE:g})")
    elif loss_error > FLIPPED_LOSS_TOLERANCE:
        why = (f"{moved} pair(s) moved at a near-tie, but the loss differs by {loss_error:.1e} "
               f"(a near-tie flip keeps it within {FLIPPED_LOSS_TOLERANCE:g})")
    else:
        why = f"{moved} pair(s) moved at a near-tie (margin {margin:.1e})"
    return {"router": first, "layer": first.rsplit(".", 1)[0] if first.endswith(".router") else first,
            "layers": differ, "moved_pairs": moved, "reference_margin": margin, "loss_error": loss_error,
            "near_tie": near_tie, "why": why, "counts": got.get(first), "reference_counts": ref.get(first)}
