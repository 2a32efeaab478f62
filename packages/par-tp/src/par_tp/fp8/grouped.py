"""The experts' grouped linear in FP8: row block ``g`` of ``x [N, I]`` times ``weight[g]^T`` (``[G, O, I]``).

An expert's rows come from several source ranks (expert parallelism brings each rank's tokens to the rank
holding the expert), sorted by expert and, within an expert, by source. The rows of one (expert, source)
segment are exactly the tokens a single rank routes to that expert in the source's micro-batch, in the same
order; each segment is therefore quantized on its own, as the single rank quantizes it: its forward input
and output gradient (per token along the features), and the weight gradient's operands along its tokens
(a tensorwise amax or a tile along the tokens never spans two sources, which hold other data). The weight
gradient of an expert is the fp32 sum of its segments' FP8 GEMMs, as the single rank accumulates its
micro-batches. The weight of an expert is quantized once for all its segments, as one rank quantizes it.

Each GEMM is :func:`~par_tp.fp8.linear.fp8_gemm` on one segment (``torch._scaled_mm`` for tensorwise and
rowwise, the exact emulation for tiles). ``Sharding.in_features`` / ``out_features``: expert tensor
parallelism's group where it splits the expert's F (w_down's input, w_gate / w_up's output).
"""

from __future__ import annotations

import torch

from .linear import Sharding, fp8_gemm, wanted
from .quantize import quantize
from .recipes import RECIPES, Recipe


def _segments(segments: torch.Tensor) -> list[tuple[int, int, int]]:
    """(group, first row, rows) of each non-empty segment, from ``[G, sources]`` counts (one host read)."""
    out, start = [], 0
    for g, row in enumerate(segments.tolist()):
        for n in row:
            if n:
                out.append((g, start, n))
            start += n
    return out


class FP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, segments: list[tuple[int, int, int]], recipe: Recipe, sharding: Sharding):
        s = sharding
        out = x.new_zeros(x.shape[0], weight.shape[1])
        qw = {}
        for g, start, n in segments:
            if g not in qw:
                qw[g] = quantize(weight[g], recipe, "weight", along=s.in_features, across=s.out_features,
                                 what=f"forward w[{g}]")
            qx = quantize(x[start:start + n], recipe, "input", along=s.in_features, what=f"forward x[{g}]")
            out[start:start + n] = fp8_gemm(qx, qw[g], recipe, x.dtype)
        ctx.save_for_backward(x, weight)
        ctx.segments, ctx.recipe, ctx.sharding = segments, recipe, sharding
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        r, s = ctx.recipe, ctx.sharding
        dy = dy.contiguous()
        dx = torch.zeros_like(x) if wanted(ctx, 0) else None
        dw = torch.zeros_like(weight) if wanted(ctx, 1) else None
        q_wt = {}
        for g, start, n in ctx.segments:
            seg_dy = dy[start:start + n]
            if dx is not None:
                if g not in q_wt:
                    q_wt[g] = quantize(weight[g].t(), r, "weight", along=s.out_features, across=s.in_features,
                                       what=f"input-grad w^T[{g}]")
                q_dy = quantize(seg_dy, r, "grad", along=s.out_features, what=f"input-grad dy[{g}]")
                dx[start:start + n] = fp8_gemm(q_dy, q_wt[g], r, x.dtype)
            if dw is not None:
                q_dyt = quantize(seg_dy.t(), r, "grad", across=s.out_features, what=f"weight-grad dy^T[{g}]")
                q_xt = quantize(x[start:start + n].t(), r, "input", across=s.in_features, what=f"weight-grad x^T[{g}]")
                dw[g] += fp8_gemm(q_dyt, q_xt, r, torch.float32).to(weight.dtype)
        return dx, dw, None, None, None


class FP8GroupedKernel:
    """The experts' ``grouped_kernel`` ``(x, weight, segments) -> y`` in FP8 (par_moe.experts.GroupedSwiGLU):
    ``segments [G, sources]``: the rows of each (group, source rank), in that order."""

    def __init__(self, recipe: str | Recipe, sharding: Sharding = Sharding()) -> None:
        self.recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        self.sharding = sharding

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        return FP8GroupedLinear.apply(x, weight, _segments(segments), self.recipe, self.sharding)

    def __deepcopy__(self, memo) -> "FP8GroupedKernel":
        return self  # immutable: a recipe and process groups (which do not copy)

    def __repr__(self) -> str:
        return f"FP8GroupedKernel({self.recipe.name})"
