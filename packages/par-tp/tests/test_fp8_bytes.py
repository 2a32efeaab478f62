"""Bytes: under every layout, each FP8 GEMM operand's data and scales (``.view(torch.uint8)``) on each rank
are bitwise the slice, at that rank's placement, of the single rank's quantization of the same tensor.

One 4-rank job runs each recipe under: tp2 column- and row-parallel with SP; cp2 (zigzag chunks); tp2 x
cp2 (both); dp2 with ZeRO-3's weight gather (each rank against one rank's run of its micro-batch); pp2
(each stage its own linear). The six operands of a linear are the forward ``x`` and ``w``, the input
gradient's ``dy`` and ``w^T`` and the weight gradient's ``dy^T`` and ``x^T``.

Planted bugs, each caught: the amax reduced over dp; rowwise without the tp reduction on a row-parallel
input; a block straddling a tp shard (refused with a message; bypassing the check changes bytes); scales
from a stale amax (the previous step's, as delayed scaling keeps).
"""

import contextlib
import importlib

import pytest
import torch
import torch.distributed as dist

from par_groups import CommRecorder, comm
from par_tp import ColumnParallelLinear, RowParallelLinear
from par_tp.fp8 import RECIPES, FP8LinearKernel, Sharding, fp8_linear, recording

fp8_linear_module = importlib.import_module("par_tp.fp8.linear")
fp8_quantize_module = importlib.import_module("par_tp.fp8.quantize")  # the package's ``quantize`` is the function

S, K, N = 512, 256, 256  # tokens (batch 1), in, out: every sharded dim a multiple of 128 per rank
RECIPE_NAMES = tuple(RECIPES)
OPERANDS = {  # what -> (rows, cols) of the full operand, in the linear's dims
    "forward x": ("M", "K"), "forward w": ("N", "K"), "input-grad dy": ("M", "N"),
    "input-grad w^T": ("K", "N"), "weight-grad dy^T": ("N", "M"), "weight-grad x^T": ("K", "M"),
}
# tp2 x cp2 shows what tp2 and cp2 each do (its scales reduce over both); they run alone in the extended tier
DEFAULT_SCENARIOS = ("tp2-cp2-column", "tp2-cp2-row", "dp2-zero3", "pp2")
EXTENDED_SCENARIOS = ("tp2-sp-column", "tp2-sp-row", "cp2")
CAUGHT_BY = {  # which recipes a bug changes bytes in (blockwise and MXFP8 reduce no amax at all)
    "amax-over-dp": ("tensorwise", "rowwise"), "rowwise-without-tp": ("tensorwise", "rowwise"),
    "block-straddles-tp": ("blockwise", "mxfp8"), "stale-amax": RECIPE_NAMES,
}
BUGS = ("amax-over-dp", "rowwise-without-tp", "block-straddles-tp", "stale-amax")


def _full_tensors(seed: int, n: int = N):
    """Inputs whose amaxes differ between shards (sequence halves, column halves), so a scale that misses
    a reduction shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, 1, K, generator=g)
    x[: S // 2] *= 3.0
    x[..., : K // 2] *= 5.0
    w = torch.randn(n, K, generator=g) * 0.05
    w[: n // 2] *= 2.0
    w[:, K // 2:] *= 7.0
    dy = torch.randn(S, 1, n, generator=g) * 1e-3
    dy[S // 4: S // 2] *= 11.0
    dy[..., n // 2:] *= 0.3
    return x, w, dy


def _run(x, w, dy, recipe, sharding=Sharding()):
    """Single-device FP8 linear forward + backward; the operands it quantized."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with recording() as taps:
        (fp8_linear(x, w, recipe, sharding) * dy).sum().backward()
    return dict(taps)


def _zigzag(cp: int, rank: int) -> torch.Tensor:
    chunk = S // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def _same(q, ref, rows: torch.Tensor, cols: torch.Tensor) -> bool:
    """``q`` is bitwise the ``[rows][:, cols]`` piece of ``ref`` (data and scales)."""
    u8 = lambda t: t.contiguous().reshape(t.shape or (1,)).view(torch.uint8)  # noqa: E731
    if not torch.equal(u8(q.data), u8(ref.data)[rows][:, cols]):
        return False
    if ref.scale.dim() == 0:
        want = ref.scale
    elif ref.block is None:  # rowwise: one per row
        want = ref.scale[rows]
    else:
        br, bc = ref.block
        if (rows[::br] % br).any() or (cols[::bc] % bc).any():
            return False  # a local tile does not start on a tile of the full operand
        scales = ref.scale.view(torch.uint8) if ref.scale.element_size() == 1 else ref.scale  # e8m0: its bytes
        want = scales[rows[::br] // br][:, cols[::bc] // bc]
    return q.scale.shape == want.shape and torch.equal(u8(q.scale), u8(want))


def _compare(taps, ref, index) -> dict[str, bool]:
    out = {}
    for what, (rdim, cdim) in OPERANDS.items():
        out[what] = what in taps and _same(taps[what], ref[what], index[rdim], index[cdim])
    return out


class _Groups:
    def __init__(self):
        rank = dist.get_rank()
        self.pairs, self.strided = None, None  # {0,1},{2,3}: tp; {0,2},{1,3}: cp / dp / pp
        for ranks in ([0, 1], [2, 3]):
            g = dist.new_group(ranks)
            self.pairs = g if rank in ranks else self.pairs
        for ranks in ([0, 2], [1, 3]):
            g = dist.new_group(ranks)
            self.strided = g if rank in ranks else self.strided


def _tp_layer(kind, recipe, tp, sharding, w):
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    extra = {} if kind == "column" else {"input_is_parallel": True}
    layer = cls.from_full(w, tp, sequence_parallel=True, **extra)
    layer.linear_kernel = FP8LinearKernel(recipe, sharding)
    return layer


def _tp_scenario(kind, recipe, tp, cp, x, w, dy, sharding=None):
    """A column- or row-parallel layer with SP on this rank's cp chunk (cp None: the whole sequence)."""
    rt = dist.get_rank(tp)
    tokens = _zigzag(2, dist.get_rank(cp)) if cp is not None else torch.arange(S)
    cp_groups = (cp,) if cp is not None else ()
    if sharding is None:
        sharding = Sharding(tokens=cp_groups, out_features=(tp,)) if kind == "column" else \
            Sharding(tokens=cp_groups, in_features=(tp,))
    layer = _tp_layer(kind, recipe, tp, sharding, w)
    n = w.shape[0]
    seq_shard = tokens.chunk(2)[rt]  # SP: this rank's share of its chunk's sequence
    k_idx, n_idx = torch.arange(K), torch.arange(n)
    if kind == "column":
        xin, up = x[seq_shard], dy[tokens][..., n_idx.chunk(2)[rt]]
        n_idx = n_idx.chunk(2)[rt]
    else:
        xin, up = x[tokens][..., k_idx.chunk(2)[rt]], dy[seq_shard]
        k_idx = k_idx.chunk(2)[rt]
    xin = xin.clone().requires_grad_()
    with CommRecorder() as rec, recording() as taps:
        y = layer(xin)
        (y * up).sum().backward()
    return dict(taps), {"M": tokens, "K": k_idx, "N": n_idx}, rec.ops()


def _cp_scenario(recipe, cp, x, w, dy):
    tokens = _zigzag(2, dist.get_rank(cp))
    taps = _run(x[tokens], w, dy[tokens], recipe, Sharding(tokens=(cp,)))
    return taps, {"M": tokens, "K": torch.arange(K), "N": torch.arange(N)}


def _dp_zero3_scenario(recipe, dp, w, bug=False):
    """Each dp rank its own micro-batch; the weight's rows sharded over dp (ZeRO-3) and gathered before use."""
    r = dist.get_rank(dp)
    x, _, dy = _full_tensors(100 + r)
    shard = w.chunk(2)[r].contiguous()
    gathered = torch.empty_like(w)
    comm.all_gather_into_tensor(gathered, shard, dp)
    taps = _run(x, gathered, dy, recipe, Sharding(tokens=(dp,)) if bug else Sharding())
    ref = _run(x, w, dy, recipe)  # one rank, this micro-batch
    return _compare(taps, ref, {"M": torch.arange(S), "K": torch.arange(K), "N": torch.arange(N)})


def _delayed_quantize(history: dict):
    """Delayed scaling: each operand quantized with the amax its first call saw (the planted bug)."""
    real = fp8_linear_module.quantize

    def quantize(x, recipe, role, along=(), across=(), amax=None, what="operand"):
        stale = history.get(what)
        if stale is None:
            history[what] = _amax_of(x, recipe, role, along, across)
        return real(x, recipe, role, along, across, amax=amax if stale is None else stale, what=what)
    return quantize


def _amax_of(x, recipe, role, along, across):
    block = recipe.block(role)
    if block is None:
        return fp8_quantize_module.max_reduce_(x.abs().max().float().reshape(()).clone(), tuple(along) + tuple(across))
    if block[1] is None:
        return fp8_quantize_module.max_reduce_(x.abs().amax(dim=1, keepdim=True).float().contiguous(), along)
    return fp8_quantize_module.tile_amax(x.contiguous(), block)


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def run_bytes_cases(scenarios=DEFAULT_SCENARIOS, bugs=True):
    groups = _Groups()
    tp, strided = groups.pairs, groups.strided
    results, ops, errors = {}, {}, {}
    everything = {"M": torch.arange(S), "K": torch.arange(K), "N": torch.arange(N)}
    for recipe in RECIPE_NAMES:
        x, w, dy = _full_tensors(7)
        ref = _run(x, w, dy, recipe)
        for kind in ("column", "row"):
            if f"tp2-sp-{kind}" in scenarios:
                taps, index, comm_ops = _tp_scenario(kind, recipe, tp, None, x, w, dy)
                results[(recipe, f"tp2-sp-{kind}")] = _compare(taps, ref, index)
            if f"tp2-cp2-{kind}" in scenarios:
                taps, index, comm_ops = _tp_scenario(kind, recipe, tp, strided, x, w, dy)
                results[(recipe, f"tp2-cp2-{kind}")] = _compare(taps, ref, index)
                ops[(recipe, kind)] = comm_ops
        if "cp2" in scenarios:
            taps, index = _cp_scenario(recipe, strided, x, w, dy)
            results[(recipe, "cp2")] = _compare(taps, ref, index)
        if "dp2-zero3" in scenarios:
            results[(recipe, "dp2-zero3")] = _dp_zero3_scenario(recipe, strided, w)
        if "pp2" in scenarios:  # stage r holds its own linear whole: one rank's quantization of it
            results[(recipe, "pp2")] = _compare(_run(x, w, dy, recipe), ref, everything)
        if not bugs:
            continue
        if recipe in CAUGHT_BY["amax-over-dp"]:
            results[(recipe, "bug:amax-over-dp")] = _dp_zero3_scenario(recipe, strided, w, bug=True)
        if recipe in CAUGHT_BY["rowwise-without-tp"]:  # torchtitan #3109's shape: the row-parallel input's local amax
            taps, index, _ = _tp_scenario("row", recipe, tp, strided, x, w, dy, sharding=Sharding(tokens=(strided,)))
            results[(recipe, "bug:rowwise-without-tp")] = _compare(taps, ref, index)
        history = {}
        x2, w2, dy2 = _full_tensors(8)
        with _patched(fp8_linear_module, "quantize", _delayed_quantize(history)):
            _run(x, w, dy, recipe)  # step 1 fills the history
            stale = _run(x2 * 4, w2, dy2, recipe)
        results[(recipe, "bug:stale-amax")] = _compare(stale, _run(x2 * 4, w2, dy2, recipe), everything)
        if recipe in CAUGHT_BY["block-straddles-tp"]:  # out 224: 112 per tp rank, not a multiple of 32 or 128
            xs, ws, dys = _full_tensors(9, n=224)
            try:
                _tp_scenario("column", recipe, tp, None, xs, ws, dys)
                errors[recipe] = None
            except ValueError as e:
                errors[recipe] = str(e)
            with _patched(fp8_quantize_module, "check_aligned", lambda *a, **k: None):
                taps, index, _ = _tp_scenario("column", recipe, tp, None, xs, ws, dys)
            results[(recipe, "bug:block-straddles-tp")] = _compare(taps, _run(xs, ws, dys, recipe), index)
    return results, ops, errors


@pytest.fixture(scope="module")
def bytes_results(dist_run):
    return dist_run(4, run_bytes_cases, timeout=300)


def _assert_same_bytes(per_rank, recipe, scenario):
    for rank, (results, _, _) in enumerate(per_rank):
        bad = [what for what, ok in results[(recipe, scenario)].items() if not ok]
        assert not bad, f"rank {rank}: {recipe} under {scenario}: {bad} differ from the single rank's quantization"


@pytest.mark.parametrize("scenario", DEFAULT_SCENARIOS)
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_operands_are_the_single_rank_bytes(bytes_results, recipe, scenario):
    _assert_same_bytes(bytes_results, recipe, scenario)


@pytest.mark.extended
def test_operands_are_the_single_rank_bytes_tp_or_cp_alone(dist_run):
    per_rank = dist_run(4, run_bytes_cases, EXTENDED_SCENARIOS, bugs=False, timeout=300)
    for scenario in EXTENDED_SCENARIOS:
        for recipe in RECIPE_NAMES:
            _assert_same_bytes(per_rank, recipe, scenario)


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_is_caught(bytes_results, bug):
    for recipe in CAUGHT_BY[bug]:
        differ = [what for results, _, _ in bytes_results for what, ok in results[(recipe, f"bug:{bug}")].items() if not ok]
        assert differ, f"{bug} under {recipe}: the bytes check did not see it"


def test_straddling_tile_is_refused(bytes_results):
    errors = bytes_results[0][2]
    for recipe, tile in (("blockwise", 128), ("mxfp8", 32)):
        assert f"fp8={recipe!r}" in errors[recipe] and "112" in errors[recipe] and f"{tile}-wide" in errors[recipe]


def test_scale_collectives_follow_the_rule(bytes_results):
    """Under tp2 x cp2: no amax reduction for tiles; tensorwise and rowwise reduce (MAX all-reduces) over
    the groups sharding the operand / its reduction dim only."""
    ops = bytes_results[0][1]
    for kind in ("column", "row"):
        assert "all_reduce" not in ops[("blockwise", kind)] and "all_reduce" not in ops[("mxfp8", kind)]
    # column: x over cp (it is gathered whole over tp), w over tp, dy over cp and tp, w^T over tp, x^T over cp
    assert ops[("tensorwise", "column")].count("all_reduce") == 6
    # rowwise: a row's amax is reduced over the groups that split the GEMM's reduction dim: the input
    # gradient's (out_features: tp, for column) or the forward's (in_features: tp, for row), and the
    # weight gradient's (tokens: cp); one reduction per operand
    assert ops[("rowwise", "column")].count("all_reduce") == 4
    assert ops[("rowwise", "row")].count("all_reduce") == 4
