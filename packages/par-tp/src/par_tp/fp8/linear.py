"""An FP8 linear ``y = x w^T``: forward, input gradient and weight gradient each one FP8 GEMM.

Each GEMM quantizes both operands along its own reduction dim (see ``recipes``): the forward ``x`` and
``w`` along in_features, the input gradient ``dy`` and ``w^T`` along out_features, the weight gradient
``dy^T`` and ``x^T`` along the tokens. :class:`Sharding` says which process groups split each of those
three dims of the full linear on this rank; ``quantize`` reduces amaxes over exactly those (tokens: cp;
in_features: tp of a row-parallel layer; out_features: tp of a column-parallel one), never over dp.

The GEMM is ``torch._scaled_mm`` for tensorwise and rowwise scales (the kernel runs them on the CPU and
on H100-class GPUs); tile scales (blockwise, MXFP8) are an exact emulation: dequantize, fp32 matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from .quantize import Quantized, max_reduce_, quantize
from .recipes import RECIPES, Recipe


@dataclass(frozen=True)
class Sharding:
    """The process groups that split each dim of the full linear ``[tokens, in] -> [tokens, out]`` here."""

    tokens: tuple[ProcessGroup, ...] = ()
    in_features: tuple[ProcessGroup, ...] = ()
    out_features: tuple[ProcessGroup, ...] = ()


def fp8_gemm(a: Quantized, b_t: Quantized, recipe: Recipe, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` from the quantized ``a`` and ``b^T [N, K]``."""
    if recipe.scaled_mm and a.scale.dtype == torch.float32:  # (an fp64 twin's scales: the emulation below)
        scale_a, scale_b = a.scale, b_t.scale.t() if b_t.scale.dim() else b_t.scale
        if a.data.device.type == "cpu" and scale_a.dim() == 0:
            # the CPU's tensorwise _scaled_mm is a slow reference loop; its rowwise kernel takes the same
            # per-tensor scale repeated per row and column (the same products, the same fp32 sums)
            scale_a, scale_b = scale_a.reshape(1, 1).repeat(a.data.shape[0], 1), scale_b.reshape(1, 1).repeat(1, b_t.data.shape[0])
        return torch._scaled_mm(a.data, b_t.data.t(), scale_a=scale_a.contiguous(), scale_b=scale_b.contiguous(),
                                out_dtype=out_dtype)
    return (a.dequantize() @ b_t.dequantize().t()).to(out_dtype)


def _tensor_amax(t: torch.Tensor, groups) -> torch.Tensor:
    return max_reduce_(t.abs().max().float().reshape(()).clone(), groups)


def wanted(ctx, i: int) -> bool:
    """Whether this backward call must produce the gradient of tensor input ``i``: required, and its node
    runs in this backward. A zero-bubble pipeline's split backward asks for the inputs' gradients alone (B),
    then for the weights' alone (W, when a ZeRO-3 weight may be released): a builtin matmul computes
    only what is asked, and so must these GEMMs (the other would be computed twice, from a weight that
    may be gone)."""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    return node is not None and torch._C._will_engine_execute_node(node)


GATHERED_ATTR = "zero3_gathered"  # where par_zero's ZeRO-3 puts a weight gathered by its gather function


def _gathered(weight: torch.Tensor) -> Quantized | None:
    """The weight's FP8 quantization gathered by ZeRO-3 (``[train].fp8_param_gather``), if it is gathered so:
    bitwise this linear's own quantization of it (par_tp.fp8.param_gather), its values never gathered."""
    q = getattr(weight, GATHERED_ATTR, None)
    return q if isinstance(q, Quantized) else None


def _regathered(param: torch.Tensor | None) -> Quantized | None:
    if param is None:
        return None
    q = _gathered(param)
    if q is None:
        raise RuntimeError("an FP8-gathered weight is not gathered for its backward (its ZeRO-3 unit's "
                           "pre-backward hook gathers it)")
    return q


class FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: Recipe, sharding: Sharding, qweight: Quantized | None = None):
        s = sharding
        x2 = x.reshape(-1, x.shape[-1])
        qx = quantize(x2, recipe, "input", along=s.in_features, across=s.tokens, what="forward x")
        gathered = _gathered(weight)
        qw = qweight if qweight is not None else gathered if gathered is not None else \
            quantize(weight, recipe, "weight", along=s.in_features, across=s.out_features, what="forward w")
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.sharding, ctx.qweight = recipe, sharding, qweight
        # a ZeRO-3 FP8 gather's weight is gathered again for the backward: holding it here would keep
        # every layer's whole weight until its backward
        ctx.gathered_param = weight if gathered is not None and qweight is None else None
        return fp8_gemm(qx, qw, recipe, x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        r, s = ctx.recipe, ctx.sharding
        dy2 = dy.reshape(-1, dy.shape[-1])
        tensorwise = r.activation_block is None
        # tensorwise: one amax per tensor serves both of its quantizations (one reduction, not two)
        dy_amax = _tensor_amax(dy2, s.tokens + s.out_features) if tensorwise else None
        dx = dw = None
        if wanted(ctx, 0):
            q_dy = quantize(dy2, r, "grad", along=s.out_features, across=s.tokens, amax=dy_amax, what="input-grad dy")
            q_w = ctx.qweight if ctx.qweight is not None else _regathered(ctx.gathered_param)
            q_wt = q_w.t() if q_w is not None else \
                quantize(weight.t(), r, "weight", along=s.out_features, across=s.in_features, what="input-grad w^T")
            dx = fp8_gemm(q_dy, q_wt, r, x.dtype).view(x.shape)
        if wanted(ctx, 1):
            x2 = x.reshape(-1, x.shape[-1])
            q_dyt = quantize(dy2.t(), r, "grad", along=s.tokens, across=s.out_features, amax=dy_amax,
                             what="weight-grad dy^T")
            q_xt = quantize(x2.t(), r, "input", along=s.tokens, across=s.in_features, what="weight-grad x^T")
            dw = fp8_gemm(q_dyt, q_xt, r, weight.dtype)
        return dx, dw, None, None, None


class FP8LinearKernel:
    """A TP layer's ``linear_kernel`` ``(x, weight, bias=None) -> y`` in FP8 (par_tp.layers._LocalMatmul)."""

    def __init__(self, recipe: str | Recipe, sharding: Sharding = Sharding()) -> None:
        self.recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        self.sharding = sharding

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = FP8Linear.apply(x, weight, self.recipe, self.sharding)
        return y if bias is None else y + bias

    def __deepcopy__(self, memo) -> "FP8LinearKernel":
        return self  # immutable: a recipe and process groups (which do not copy)

    def __repr__(self) -> str:
        return f"FP8LinearKernel({self.recipe.name})"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str, sharding: Sharding = Sharding(),
               qweight: Quantized | None = None) -> torch.Tensor:
    """``x @ weight^T`` with FP8 GEMMs in every pass; ``qweight``: the weight already quantized (an FP8
    parameter gather's), for the forward and, transposed, the input gradient."""
    return FP8Linear.apply(x, weight, RECIPES[recipe], sharding, qweight)
