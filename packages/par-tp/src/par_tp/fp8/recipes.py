"""par's FP8 recipes: which format and which scaling block each GEMM operand gets.

Every GEMM ``C[M, N] = A[M, K] @ B[K, N]`` quantizes both operands along its reduction dim K: ``A`` as
``[M, K]`` and ``B`` as ``B^T [N, K]``, so one quantizer serves the forward (``x @ w^T``), the input
gradient (``dy @ w``) and the weight gradient (``dy^T @ x``). A block is ``(rows, cols)`` of that
``[rows, K]`` view; ``None`` is one scale per tensor (tensorwise) and ``(1, None)`` one per row
(rowwise, a whole row of K).

The formats follow each recipe's reference: tensorwise and rowwise take e4m3 forward and e5m2 for
gradients (Transformer Engine's HYBRID, torchao's tensorwise default); blockwise takes e4m3 for every
tensor with 1x128 activation / gradient tiles and 128x128 weight blocks (DeepSeek-V3, scale = amax /
448); MXFP8 takes e4m3 everywhere with 1x32 blocks along K and e8m0 (power-of-two) scales (OCP MX).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Recipe:
    name: str
    grad_dtype: torch.dtype  # the output gradient's format; inputs and weights are always e4m3
    activation_block: tuple[int, int | None] | None  # None: tensorwise; (1, None): rowwise; else a tile
    weight_block: tuple[int, int | None] | None
    power_of_two_scales: bool = False  # rowwise rounds scales down to 2^k, as torchao's rowwise recipe does
    e8m0: bool = False  # MXFP8: the scale is a power of two stored as one e8m0 byte
    scaled_mm: bool = True  # the GEMM runs on torch._scaled_mm (else dequantize + fp32 matmul, exact)

    def block(self, role: str) -> tuple[int, int | None] | None:
        return self.weight_block if role == "weight" else self.activation_block

    def dtype(self, role: str) -> torch.dtype:
        return self.grad_dtype if role == "grad" else E4M3

    @property
    def block_multiple(self) -> int:
        """The multiple every sharded local dim must be (1: scales are reduced instead)."""
        block = self.weight_block
        return 1 if block is None or block[1] is None else max(self.weight_block[0], self.activation_block[1])


RECIPES = {
    "tensorwise": Recipe("tensorwise", E5M2, None, None),
    "rowwise": Recipe("rowwise", E5M2, (1, None), (1, None), power_of_two_scales=True),
    "blockwise": Recipe("blockwise", E4M3, (1, 128), (128, 128), scaled_mm=False),
    "mxfp8": Recipe("mxfp8", E4M3, (1, 32), (1, 32), e8m0=True, scaled_mm=False),
}
