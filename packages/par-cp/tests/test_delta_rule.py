"""The gated delta rule and its context parallelism (``delta_rule.py``, ``state_passing.py``).

The chunked rule equals the token-by-token recurrence (float64) with any initial state; its affine form
reproduces it for any incoming state. On 2 and 4 ranks (zigzag) the state pass and the conv halo give the
single-device output and gradients (fp32 <= 1e-5 relative), with packed documents too; each rank moves one
``[B, H, dk, dv]`` state per boundary between its pieces and its neighbours' (forward and backward).
Three planted bugs are caught: the state passed without the transition, the conv halo taken from the ring's
previous rank instead of the previous piece's holder, a document starting at a piece's first token not
resetting the incoming state.
"""

import pytest
import torch
import torch.nn.functional as F

B, H, S, DK, DV, K = 2, 2, 32, 8, 6, 4
TOL = 1e-5
DOCS = (0, 3, 8, 19, 32)  # 8 starts a piece at cp 2 and cp 4 (zigzag pieces of 8 and 4 tokens)
SEQ_DOCS = [DOCS, (0, 12, 13, 32)]


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, S, DK, generator=gen), dim=-1) * DK ** -0.5
    k = F.normalize(torch.randn(B, H, S, DK, generator=gen), dim=-1)
    v = torch.randn(B, H, S, DV, generator=gen)
    g = -F.softplus(torch.randn(B, H, S, generator=gen))
    beta = torch.rand(B, H, S, generator=gen)
    x = torch.randn(S, B, 5, generator=gen)  # the conv's input
    w = torch.randn(5, K, generator=gen)
    return [q, k, v, g, beta], x, w, torch.randn(B, H, S, DV, generator=gen), torch.randn(S, B, 5, generator=gen)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _reference_rule(tensors, docs):
    from par_cp.delta_rule import recurrent_delta_rule

    per = docs if isinstance(docs, list) else [docs or (0, S)] * B
    out = torch.zeros(B, H, S, DV, dtype=torch.float64)
    for b in range(B):
        for a, e in zip(per[b], per[b][1:]):
            out[b:b + 1, :, a:e] = recurrent_delta_rule(*(t[b:b + 1, :, a:e] for t in tensors))[0]
    return out


def _reference_conv(x, w, docs):
    per = docs if isinstance(docs, list) else [docs or (0, S)] * B
    out = torch.zeros_like(x)
    for b in range(B):
        for a, e in zip(per[b], per[b][1:]):
            seg = x[a:e, b].t()[None]  # [1, C, T]
            out[a:e, b] = F.conv1d(seg, w[:, None, :], padding=K - 1, groups=w.shape[0])[0, :, :e - a].t()
    return out


def test_chunked_rule_equals_the_recurrence_from_any_state():
    from par_cp.delta_rule import affine_delta_rule, chunked_delta_rule, recurrent_delta_rule

    tensors = _inputs(0)[0]
    s0 = torch.randn(B, H, DK, DV)
    ref, ref_s = recurrent_delta_rule(*(t.double() for t in tensors), s0.double())
    out, s = chunked_delta_rule(*tensors, s0, chunk=8)  # 4 chunks
    assert _rel(out, ref) <= TOL and _rel(s, ref_s) <= TOL
    o, qt, s_loc, a = affine_delta_rule(*(t[:, :, :13] for t in tensors), chunk=8)  # a ragged last chunk
    ref, ref_s = recurrent_delta_rule(*(t[:, :, :13].double() for t in tensors), s0.double())
    assert _rel(o + qt @ s0, ref) <= TOL and _rel(s_loc + a @ s0, ref_s) <= TOL


def run_cp(world, cp, docs, plant=None, layout="zigzag"):
    """This rank's errors of the CP rule and conv against one device, and its sends forward / backward."""
    import par_cp.state_passing as sp

    saved = sp._compose, sp.halo_sources, sp.resets_at_piece_start
    try:
        return _run_cp(world, cp, docs, plant, sp, layout)
    finally:  # the rank workers serve later tests
        sp._compose, sp.halo_sources, sp.resets_at_piece_start = saved


def _run_cp(world, cp, docs, plant, sp, layout):
    from par_groups import CommRecorder, RankGrid, create_groups
    from par_cp import shard_sequence

    if plant == "no_decay":
        sp._compose = lambda s_local, a, s_in: s_local + s_in
    elif plant == "ring_halo":  # a naive ring: the previous rank's piece of the same index
        sp.halo_sources = lambda pieces: {(r, i): ((r - 1) % cp, i) if r else None for _, _, r, i in pieces}
    elif plant == "no_reset":
        sp.resets_at_piece_start = lambda starts, a: False
    groups = create_groups(RankGrid(world, cp=cp))
    rank = groups.rank_in("cp")
    tensors, x, w, d_out, d_conv = _inputs(1)
    local = [shard_sequence(t, rank, cp, dim=2, layout=layout).requires_grad_() for t in tensors]
    with CommRecorder() as fwd:
        out = sp.context_parallel_delta_rule(*local, groups.cp, S, layout, cu_seqlens=docs)
    with CommRecorder() as bwd:
        out.backward(shard_sequence(d_out, rank, cp, dim=2, layout=layout))
    full = [t.double().requires_grad_() for t in tensors]
    ref = _reference_rule(full, docs)
    ref.backward(d_out.double())
    errors = {"out": _rel(out, shard_sequence(ref, rank, cp, dim=2, layout=layout))}
    errors |= {f"d{i}": _rel(mine.grad, shard_sequence(t.grad, rank, cp, dim=2, layout=layout))
               for i, (mine, t) in enumerate(zip(local, full))}
    from par_cp import position_ids

    xl = shard_sequence(x, rank, cp, layout=layout).requires_grad_()
    pos = None
    if docs is not None:
        per = docs if isinstance(docs, list) else [docs] * B
        pos = torch.stack([position_ids(S, rank, cp, layout=layout, cu_seqlens=d) for d in per], 1)
    conv = sp.causal_conv1d(xl, w, groups.cp, S, layout, positions=pos)
    conv.backward(shard_sequence(d_conv, rank, cp, layout=layout))
    xf = x.double().requires_grad_()
    ref_conv = _reference_conv(xf, w.double(), docs)
    ref_conv.backward(d_conv.double())
    errors |= {"conv": _rel(conv, shard_sequence(ref_conv, rank, cp, layout=layout)),
               "dconv": _rel(xl.grad, shard_sequence(xf.grad, rank, cp, layout=layout))}
    sends = [(r.op, r.bytes) for r in fwd.records], [(r.op, r.bytes) for r in bwd.records]
    return errors, sends


@pytest.fixture(scope="module")
def cp_results(dist_run):
    """Each case's per-rank results, run once when a test first asks."""
    cache = {}

    def get(cp, docs):
        if (cp, str(docs)) not in cache:
            cache[(cp, str(docs))] = dist_run(4, run_cp, 4, cp, docs, timeout=300)
        return cache[(cp, str(docs))]

    return get


@pytest.mark.parametrize("cp, docs", [(2, None), (2, DOCS), pytest.param(2, SEQ_DOCS, marks=pytest.mark.extended),
                                      pytest.param(4, None, marks=pytest.mark.extended), (4, DOCS)],
                         ids=["cp2", "cp2-packed", "cp2-varlen", "cp4", "cp4-packed"])
def test_context_parallel_delta_rule_and_conv_equal_one_device(cp_results, cp, docs):
    for rank, (errors, _) in enumerate(cp_results(cp, docs)):
        assert max(errors.values()) <= TOL, (rank, errors)


@pytest.mark.parametrize("cp, docs", [(2, None), (4, DOCS)])
def test_each_boundary_moves_one_state_each_way(cp_results, cp, docs):
    """Forward and backward, a rank sends one state per boundary its pieces have with another rank's."""
    state = B * H * DK * DV * 4
    for rank, (_, (fwd, bwd)) in enumerate(cp_results(cp, docs)):
        boundaries = 1 if cp == 2 else (1 if rank in (0, cp - 1) else 2)  # zigzag: a piece at each end
        assert fwd == [("send", state)] * boundaries and bwd == [("send", state)] * boundaries, (rank, fwd, bwd)


def test_contiguous_layout_equals_one_device(dist_run):
    """One piece a rank: the first rank only sends (its exchange's backward still runs)."""
    for rank, (errors, _) in enumerate(dist_run(4, run_cp, 4, 4, DOCS, None, "contiguous", timeout=300)):
        assert max(errors.values()) <= TOL, (rank, errors)


@pytest.mark.parametrize("plant, cp, docs, caught", [("no_decay", 2, None, "out"), ("ring_halo", 4, None, "conv"),
                                                     ("no_reset", 2, DOCS, "out")])
def test_planted_bugs_are_caught(dist_run, plant, cp, docs, caught):
    results = dist_run(4, run_cp, 4, cp, docs, plant, timeout=300)
    assert max(errors[caught] for errors, _ in results) > 1e-2, results


def test_the_rule_stays_fp32_under_bf16_autocast():
    """A bf16 run (autocast on GPUs) keeps the chunked rule in fp32: its matmuls are not cast."""
    from par_cp.delta_rule import chunked_delta_rule

    tensors = _inputs(0)[0]
    want, want_s = chunked_delta_rule(*tensors)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, s = chunked_delta_rule(*tensors)
    assert got.dtype == s.dtype == torch.float32 and torch.equal(got, want) and torch.equal(s, want_s)
    from par_cp.state_passing import context_parallel_delta_rule

    with torch.autocast("cpu", dtype=torch.bfloat16):  # the layer calls this one
        got = context_parallel_delta_rule(*tensors, layout="zigzag")
    assert got.dtype == torch.float32 and _rel(got, want) <= TOL
