"""FP8 experts under expert parallelism quantize the single rank's bytes: on each ep2 rank, every FP8 GEMM
operand of an expert (the forward input and weight, the input gradient's output gradient and weight, the
weight gradient's operands along the tokens) is bitwise the one a single rank quantizes when it runs the
source rank's micro-batch through the whole MoE layer (rows of one source, in the same order). Both
dispatchers. The collectives of the FP8 run, counted by dtype: the same all-to-all bytes, in the tokens'
dtype, as the high-precision run; the FP8 experts add no collective (their scales reduce over nothing
under ep).

The 20-step ep2 training comparison is in tests/test_layouts_fp8.py (extended tier).
"""

import pytest
import torch
import torch.distributed as dist

from par_groups import CommRecorder
from par_moe import MoEConfig, MoELayer
from par_tp.fp8 import RECIPES, FP8GroupedKernel, Sharding, recording

T, H, F, E = 24, 64, 64, 4  # tokens per rank, hidden, expert width, experts (2 per ep rank)


def _layer(ep_group, dispatcher, recipe, seed=5):
    torch.manual_seed(seed)
    cfg = MoEConfig(hidden=H, ffn_hidden=F, num_experts=E, top_k=2, dispatcher=dispatcher)
    full = MoELayer(cfg)  # the full weights, the same on every rank
    layer = MoELayer(cfg, ep_group)
    layer.load_full_(full.router.weight, full.experts.w_gate, full.experts.w_up, full.experts.w_down)
    if recipe is not None:
        layer.experts.grouped_kernels = (FP8GroupedKernel(recipe), FP8GroupedKernel(recipe), FP8GroupedKernel(recipe))
    return layer


def _data(source):
    g = torch.Generator().manual_seed(40 + source)
    x = torch.randn(T, H, generator=g) * (1 + 3 * source)  # the sources' amaxes differ
    return x, torch.randn(T, H, generator=g) * 1e-2


def _step(layer, x, up):
    x = x.clone().requires_grad_()
    with recording() as taps, CommRecorder() as rec:
        y, _ = layer(x)
        (y * up).sum().backward()
    return taps, rec


def _by_operand(taps):
    """what -> the list of its quantizations (segments in order)."""
    out = {}
    for what, q in taps:
        out.setdefault(what, []).append(q)
    return out


def _u8(t):
    return t.contiguous().reshape(t.shape or (1,)).view(torch.uint8)


def ep2_job():
    rank, ep = dist.get_rank(), dist.group.WORLD
    local = E // 2
    out = {}
    for dispatcher in ("alltoall", "allgather"):
        # the sources' rows are the dispatcher's; the recipes' quantizers are the same for either
        for recipe in RECIPES if dispatcher == "alltoall" else ("rowwise",):
            taps, rec = _step(_layer(ep, dispatcher, recipe), *_data(rank))
            mine = _by_operand(taps)
            # the single rank: the same layer whole, one source's micro-batch after the other
            single = [_by_operand(_step(_layer(None, dispatcher, recipe), *_data(s))[0]) for s in (0, 1)]
            same = {}
            for what, qs in mine.items():
                name, g = what[:-3], int(what[-2])
                want_name = f"{name}[{rank * local + g}]"
                if name.endswith((" w", "w^T")):  # the weights: once per projection (per source there)
                    want = next(single[s][want_name] for s in (0, 1) if want_name in single[s])
                else:  # each projection (3 calls): one segment per source, in source order
                    want = [single[s][want_name][p] for p in range(3) for s in (0, 1) if want_name in single[s]]
                same[what] = len(qs) == len(want) and all(
                    torch.equal(_u8(a.data), _u8(b.data)) and torch.equal(_u8(a.scale), _u8(b.scale))
                    for a, b in zip(qs, want))
            out[(dispatcher, recipe)] = (same, rec.bytes_by_dtype(), rec.count("all_reduce"))
        _, rec = _step(_layer(ep, dispatcher, None), *_data(rank))
        out[(dispatcher, "off")] = ({}, rec.bytes_by_dtype(), rec.count("all_reduce"))
    return out


@pytest.mark.timeout(300)
def test_ep2_fp8_experts_quantize_the_single_ranks_bytes(dist_run):
    per_rank = dist_run(2, ep2_job, timeout=300)
    for rank, results in enumerate(per_rank):
        for (dispatcher, recipe), (same, by_dtype, reductions) in results.items():
            if recipe == "off":
                continue
            # every operand of both local experts: 2 weights and 4 activation operands, each
            assert len(same) >= 12 and all(same.values()), (rank, dispatcher, recipe, same)
            # the wire: what the high-precision run moves (tokens in fp32), and no amax reduction
            assert by_dtype == results[(dispatcher, "off")][1], (rank, dispatcher, recipe, by_dtype)
            assert reductions == results[(dispatcher, "off")][2]
            assert set(by_dtype) <= {"float32", "int64"}, by_dtype


def test_expert_scales_follow_expert_tp():
    """The trainer's wiring: w_gate / w_up split F like a column-parallel layer (out_features over etp),
    w_down like a row-parallel one (in_features over etp); tokens over nothing (one source per segment)."""
    from types import SimpleNamespace

    from pretrain.model.fp8 import use_fp8_linears_

    layer = MoELayer(MoEConfig(hidden=H, ffn_hidden=F, num_experts=E, top_k=2, num_shared_experts=1))
    etp, tp, cp = object(), object(), object()
    use_fp8_linears_(layer, "rowwise", SimpleNamespace(etp=etp, tp=tp, cp=cp))
    gate, up, down = layer.experts.grouped_kernels
    assert gate.sharding == up.sharding == Sharding(out_features=(etp,)) and down.sharding == Sharding(in_features=(etp,))
    assert layer.shared.linear_kernel.sharding == Sharding(tokens=(cp, tp))
