"""par's FP8 quantizers and linear on one rank against outside definitions.

- tensorwise and rowwise linears equal torchao's ``Float8Linear`` configured with the same recipe (e4m3
  inputs and weights, e5m2 output gradients; rowwise with power-of-two scales, as torchao's rowwise
  recipe), in the forward and both gradients. Rowwise is compared with torchao's exact path
  (``emulate=True``: dequantize, fp32 matmul): its kernel path rounds an fp32 rowwise output through bf16;
- blockwise equals DeepSeek-V3's definition (1x128 activation tiles, 128x128 weight tiles, scale =
  amax / 448, ``x / scale`` cast to e4m3), computed here tile by tile;
- MXFP8 equals the OCP MX definition (1x32 blocks, shared exponent floor(log2 amax) - 8 stored as an
  e8m0 byte, elements ``x / 2^e`` in e4m3), computed here block by block.
"""

import math

import pytest
import torch

from par_tp.fp8 import RECIPES, fp8_linear, quantize

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _torchao_config(recipe: str, emulate: bool):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import CastConfig, ScalingGranularity

    gran = ScalingGranularity.TENSORWISE if recipe == "tensorwise" else ScalingGranularity.AXISWISE
    cast = lambda dtype: CastConfig(scaling_granularity=gran, target_dtype=dtype)  # noqa: E731
    return Float8LinearConfig(
        cast_config_input=cast(E4), cast_config_input_for_grad_weight=cast(E4), cast_config_weight=cast(E4),
        cast_config_weight_for_grad_input=cast(E4), cast_config_grad_output=cast(E5),
        cast_config_grad_output_for_grad_weight=cast(E5), round_scales_to_power_of_2=recipe == "rowwise",
        emulate=emulate)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_linear_matches_torchao_float8_linear(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8 import convert_to_float8_training

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, 64, generator=g), torch.randn(48, 64, generator=g) * 0.1
    up = torch.randn(4, 8, 48, generator=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xr, wr, recipe)
    (y * up).sum().backward()
    ref = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))
    ref[0].weight.data.copy_(w)
    convert_to_float8_training(ref, config=_torchao_config(recipe, emulate=recipe == "rowwise"))
    assert type(ref[0]).__name__ == "Float8Linear"
    xt = x.clone().requires_grad_()
    yt = ref(xt)
    (yt * up).sum().backward()
    errors = _rel(y, yt), _rel(xr.grad, xt.grad), _rel(wr.grad, ref[0].weight.grad)
    assert max(errors) <= 1e-6, errors
    assert _rel(y, x @ w.t()) > 1e-3  # FP8 is applied: not the fp32 product


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _deepseek_tiles(x, rows, cols):
    """DeepSeek-V3's fine-grained quantization, tile by tile: scale = amax / 448, q = x / scale."""
    data, scales = torch.empty(x.shape, dtype=E4), torch.empty(math.ceil(x.shape[0] / rows), math.ceil(x.shape[1] / cols))
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], cols):
            tile = x[i:i + rows, j:j + cols]
            scale = tile.abs().max() / 448.0
            scales[i // rows, j // cols] = scale
            data[i:i + rows, j:j + cols] = (tile / scale).to(E4)
    return data, scales


def test_blockwise_is_deepseek_v3_definition():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 320, generator=g) * torch.logspace(-3, 2, 320)  # 2.5 tiles per row, scales 1e5 apart
    w = torch.randn(200, 256, generator=g) * 0.02
    recipe = RECIPES["blockwise"]
    for t, role, tile in ((x, "input", (1, 128)), (w, "weight", (128, 128)), (x, "grad", (1, 128))):
        q = quantize(t, recipe, role)
        data, scales = _deepseek_tiles(t, *tile)
        assert torch.equal(_bytes(q.data), _bytes(data)), role
        assert torch.equal(_bytes(q.scale), _bytes(scales)), role
        assert q.data.dtype == E4


def _mx_blocks(x, size=32):
    """The OCP MX spec (v1.0, 6.3) for e4m3: X = 2^(floor(log2 amax) - 8) per block, stored as e8m0."""
    data, exps = torch.empty(x.shape, dtype=E4), torch.empty(x.shape[0], math.ceil(x.shape[1] / size), dtype=torch.uint8)
    for i in range(x.shape[0]):
        for j in range(0, x.shape[1], size):
            block = x[i, j:j + size]
            exponent = math.frexp(block.abs().max().item())[1] - 1 - 8  # floor(log2 amax) - emax_elem
            exps[i, j // size] = exponent + 127  # e8m0: biased exponent, no mantissa
            data[i, j:j + size] = (block / 2.0 ** exponent).clamp(-448, 448).to(E4)
    return data, exps


def test_mxfp8_is_ocp_mx_definition():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 96, generator=g) * torch.logspace(-4, 3, 96)
    x[0, :32] = 2.0 ** torch.arange(-16, 16).float()  # amax exactly a power of two
    q = quantize(x, RECIPES["mxfp8"], "input")
    data, exps = _mx_blocks(x)
    assert q.scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(_bytes(q.scale), exps)
    assert torch.equal(_bytes(q.data), _bytes(data))


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_emulated_gemm_is_dequantized_fp32_matmul(recipe):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(256, 256, generator=g), torch.randn(128, 256, generator=g)
    r = RECIPES[recipe]
    y = fp8_linear(x, w, recipe)
    assert torch.equal(y, quantize(x, r, "input").dequantize() @ quantize(w, r, "weight").dequantize().t())
    assert 1e-3 < _rel(y, x @ w.t()) < 0.1
