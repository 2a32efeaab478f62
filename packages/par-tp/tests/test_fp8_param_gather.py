"""FP8 parameter all-gather (ZeRO-3): each of 2 ranks quantizes its half of a weight's rows, the gather moves
FP8 bytes and scales; the gathered weight is bitwise the single device's quantization (data and scales,
``.view(torch.uint8)``), serves the input gradient transposed, and an FP8 linear on it gives the single
device's output and gradients bitwise. The recorded bytes, by dtype, are the formula (FP8 data + fp32
scales), <= 0.52 x the bf16 gather's. Rowwise and MXFP8 are refused (two quantizations of one weight)."""

import pytest
import torch
import torch.distributed as dist

from par_groups import CommRecorder, comm
from par_tp.fp8 import RECIPES, fp8_linear, gather_bytes, gather_quantized, quantize

N, K, S = 256, 384, 64  # out (two 128-row shards), in, tokens


def _u8(t):
    return t.contiguous().reshape(t.shape or (1,)).view(torch.uint8)


def _same(a, b) -> bool:
    return torch.equal(_u8(a.data), _u8(b.data)) and torch.equal(_u8(a.scale), _u8(b.scale))


def _weight():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g) * 0.02
    w[N // 2:] *= 9.0  # the shards' amaxes differ
    return w.bfloat16().float()  # bf16 master values, so the bf16 gather carries them exactly


def gather_job():
    rank, group = dist.get_rank(), dist.group.WORLD
    w = _weight()
    shard = w.chunk(2)[rank].contiguous()
    g = torch.Generator().manual_seed(11)
    x, dy = torch.randn(S, K, generator=g), torch.randn(S, N, generator=g)
    out = {}
    for recipe in ("tensorwise", "blockwise"):
        r = RECIPES[recipe]
        with CommRecorder() as rec:
            q = gather_quantized(shard, recipe, group)
        single = quantize(w, r, "weight")
        single_t = quantize(w.t(), r, "weight")
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
        ya, yb = fp8_linear(a, wa, recipe, qweight=q), fp8_linear(b, wb, recipe)
        (ya * dy).sum().backward()
        (yb * dy).sum().backward()
        linear_same = all(torch.equal(u, v) for u, v in ((ya, yb), (a.grad, b.grad), (wa.grad, wb.grad)))
        out[recipe] = (_same(q, single), _same(q.t(), single_t), linear_same, rec.bytes_by_dtype(), rec.total_bytes())
    with CommRecorder() as rec:  # today's gather of the bf16 weight
        full = torch.empty(N, K, dtype=torch.bfloat16)
        comm.all_gather_into_tensor(full, shard.bfloat16(), group)
    out["bf16"] = rec.total_bytes()
    errors = []
    for recipe in ("rowwise", "mxfp8"):
        try:
            gather_quantized(shard, recipe, group)
        except ValueError as e:
            errors.append(str(e))
    return out, errors


@pytest.fixture(scope="module")
def gathered(dist_run):
    return dist_run(2, gather_job, timeout=120)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_gathered_weight_is_the_single_devices_quantization(gathered, recipe):
    for rank, (out, _) in enumerate(gathered):
        forward, transposed, linear, _, _ = out[recipe]
        assert forward and transposed and linear, (rank, recipe, forward, transposed, linear)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_gather_bytes_are_the_formula_and_half_of_bf16(gathered, recipe):
    out, _ = gathered[0]
    by_dtype, total = out[recipe][3], out[recipe][4]
    assert total == gather_bytes(N, K, recipe) and total <= 0.52 * out["bf16"], (total, out["bf16"])
    assert by_dtype["float8_e4m3fn"] == N * K and by_dtype["float32"] == total - N * K, by_dtype


def test_rowwise_and_mxfp8_gathers_are_refused(gathered):
    errors = gathered[0][1]
    assert len(errors) == 2 and all("'tensorwise' or 'blockwise'" in e for e in errors), errors
