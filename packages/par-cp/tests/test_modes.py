"""Every CP mode on 2 and 4 ranks equals single-device attention on the full sequence (output and
dQ, dK, dV, fp32, relative error <= 1e-5), with and without documents; communication counted.

Many cases run in one multi-rank job (starting ranks is the slow part); each rank computes the
float64 reference on the full sequence itself and compares its own shard.
"""

import pytest
import torch

S, B, D = 32, 2, 8
TOL = 1e-5
DOCS = (0, 3, 17, 18, 32)  # documents cross shard borders, one is a single token
SEQ_DOCS = [DOCS, (0, 9, 10, 25, 32)]  # packed: each sequence of the batch has its own boundaries


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _groups(world, cp, hcp=None):
    from par_groups import RankGrid, create_groups

    return create_groups(RankGrid(world, cp=cp, hcp=hcp))


def _run_case(groups, case):
    """One case on this rank: errors of output and gradients, and what was communicated."""
    from par_cp import ContextParallelAttention, shard_sequence
    from par_cp.reference import reference_attention
    from par_groups import CommRecorder

    mode, layout, causal, hq, hkv, docs, backend = (case[k] for k in ("mode", "layout", "causal", "hq", "hkv", "docs", "backend"))
    gen = torch.Generator().manual_seed(case["seed"])  # the same inputs on every rank
    q, k, v = (torch.randn(S, B, h, D, generator=gen) for h in (hq, hkv, hkv))
    dout = torch.randn(S, B, hq, D, generator=gen)
    if mode == "a2a+p2p":
        attn = ContextParallelAttention(mode, groups.cp, inner_group=groups.hcp[0], outer_group=groups.hcp[1], causal=causal, layout=layout, backend=backend)
    else:
        attn = ContextParallelAttention(mode, groups.cp, causal=causal, layout=layout, backend=backend)
    rank, cp = groups.rank_in("cp"), groups.size("cp")
    local = [shard_sequence(t, rank, cp, layout=layout).requires_grad_() for t in (q, k, v)]
    with CommRecorder() as fwd:
        out = attn(*local, cu_seqlens=docs)
    with CommRecorder() as bwd:
        out.backward(shard_sequence(dout, rank, cp, layout=layout))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    per_seq = docs if isinstance(docs, list) else [docs] * B  # the reference runs each sequence alone
    ref = torch.cat([reference_attention(*(t[:, b:b + 1] for t in full), causal=causal, cu_seqlens=per_seq[b])
                     for b in range(B)], dim=1)
    ref.backward(dout.double())
    errors = {"out": _rel(out, shard_sequence(ref, rank, cp, layout=layout))}
    for name, mine, theirs in zip(("dq", "dk", "dv"), local, full):
        errors[name] = _rel(mine.grad, shard_sequence(theirs.grad, rank, cp, layout=layout))
    kv_bytes = 2 * local[1].numel() * local[1].element_size()
    return {"errors": errors, "fwd": fwd.records, "bwd": bwd.records, "kv_bytes": kv_bytes, "cp": cp}


def run_cases(world, cp, hcp, cases):
    groups = _groups(world, cp, hcp)
    return [_run_case(groups, c) for c in cases]


def check_head_error(world):
    from par_cp import ContextParallelAttention

    groups = _groups(world, world)
    q, k = torch.zeros(8, 1, 4, 8), torch.zeros(8, 1, 2, 8)
    try:
        ContextParallelAttention("a2a", groups.cp)(q, k, k)
    except ValueError as e:
        return str(e)
    return None


def _case(mode, layout="zigzag", causal=True, hq=4, hkv=4, docs=None, backend="auto"):
    seed = len(mode) * 7 + len(layout) * 3 + causal + hq * 11 + hkv * 13
    return dict(mode=mode, layout=layout, causal=causal, hq=hq, hkv=hkv, docs=docs, backend=backend, seed=seed)


def _name(c):
    heads = "mha" if c["hq"] == c["hkv"] else "gqa"
    return f"{c['mode']}-{c['layout']}-{'causal' if c['causal'] else 'full'}-{heads}{'-varlen' if isinstance(c['docs'], list) else '-packed' if c['docs'] else ''}-{c['backend']}"


CP4_CASES = (
    [_case(m, lay, causal, hq, hkv) for m in ("p2p", "allgather", "a2a", "a2a+p2p")
     for lay, causal in (("zigzag", True), ("contiguous", True), ("contiguous", False))
     for hq, hkv in ((4, 4), (8, 4))]
    + [_case(m, docs=DOCS, hq=8, hkv=4) for m in ("p2p", "allgather", "a2a", "a2a+p2p")]
    + [_case(m, "contiguous", False, docs=DOCS) for m in ("p2p", "a2a")]
    + [_case("p2p", backend="torch"), _case("a2a+p2p", hq=8, hkv=4, docs=DOCS, backend="torch")]
    + [_case(m, docs=SEQ_DOCS, hq=8, hkv=4) for m in ("p2p", "allgather", "a2a", "a2a+p2p")]
)
CP2_CASES = [_case(m, lay, causal, 4, 2) for m in ("p2p", "allgather", "a2a")
             for lay, causal in (("zigzag", True), ("contiguous", False))] + [_case("p2p", docs=DOCS, hq=4, hkv=2)] + [
    _case(m, docs=SEQ_DOCS, hq=4, hkv=2) for m in ("p2p", "a2a")]


@pytest.fixture(scope="module")
def cp4_results(dist_run):
    return dist_run(4, run_cases, 4, 4, (2, 2), CP4_CASES, timeout=300)  # the first job pays worker warm-up


@pytest.fixture(scope="module")
def cp2_results(dist_run):
    # cp=2 inside a 4-rank world (two CP groups side by side), so ring peers are not world ranks
    return dist_run(4, run_cases, 4, 2, None, CP2_CASES, timeout=300)


def _assert_close(results, index):
    for rank, per_rank in enumerate(results):
        errors = per_rank[index]["errors"]
        assert max(errors.values()) <= TOL, f"rank {rank}: {errors}"


@pytest.mark.parametrize("index", range(len(CP4_CASES)), ids=[_name(c) for c in CP4_CASES])
def test_cp4_matches_single_device(cp4_results, index):
    _assert_close(cp4_results, index)


@pytest.mark.parametrize("index", range(len(CP2_CASES)), ids=[_name(c) for c in CP2_CASES])
def test_cp2_matches_single_device(cp2_results, index):
    _assert_close(cp2_results, index)


def _sends(records):
    return [r.bytes for r in records if r.op == "send"]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_sends_cp_minus_1_kv_blocks_forward_and_matching_dkv_backward(cp, cp2_results, cp4_results):
    results, cases = (cp2_results, CP2_CASES) if cp == 2 else (cp4_results, CP4_CASES)
    index = next(i for i, c in enumerate(cases) if c["mode"] == "p2p")
    for per_rank in results:
        r = per_rank[index]
        assert r["cp"] == cp
        assert _sends(r["fwd"]) == [r["kv_bytes"]] * (cp - 1)  # one packed K|V shard per step
        assert _sends(r["bwd"]) == [r["kv_bytes"]] * (2 * (cp - 1))  # K|V again, and dK|dV home
        assert {x.op for x in r["fwd"] + r["bwd"]} == {"send"}


def test_ulysses_two_all_to_all_phases(cp4_results):
    index = next(i for i, c in enumerate(CP4_CASES) if c["mode"] == "a2a")
    for per_rank in cp4_results:
        r = per_rank[index]
        assert [x.op for x in r["fwd"]] == ["all_to_all", "all_to_all"]
        assert [x.op for x in r["bwd"]] == ["all_to_all", "all_to_all"]
        assert r["fwd"][0].bytes == 3 * r["kv_bytes"] // 2  # q, k, v (MHA) in one call


def test_allgather_gathers_kv_once_and_reduce_scatters_gradients(cp4_results):
    index = next(i for i, c in enumerate(CP4_CASES) if c["mode"] == "allgather")
    for per_rank in cp4_results:
        r = per_rank[index]
        assert [(x.op, x.bytes) for x in r["fwd"]] == [("all_gather", 4 * r["kv_bytes"])]
        assert [x.op for x in r["bwd"]] == ["reduce_scatter"]


def test_hierarchical_uses_inner_a2a_and_outer_ring(cp4_results):
    index = next(i for i, c in enumerate(CP4_CASES) if c["mode"] == "a2a+p2p")
    for per_rank in cp4_results:
        fwd = per_rank[index]["fwd"]
        assert [(x.op, x.group_size) for x in fwd] == [("all_to_all", 2), ("send", 2), ("all_to_all", 2)]


def test_ulysses_rejects_heads_not_divisible(dist_run):
    messages = dist_run(4, check_head_error, 4)
    assert all("local key/value heads=2" in m and "not divisible by 4" in m for m in messages)
