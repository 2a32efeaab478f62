"""A TP / SP transformer block equals the single-device block: output, input grad, every param grad.

One 4-rank job runs every case (TP = 1, 2, 4 from sub-groups of the world, with and without
SP, MHA and GQA with KV heads split or replicated) against a reference written here in
plain torch; it also records the collectives and the activations the norms save.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from par_groups import CommRecorder
from par_tp.testing import TPTransformerBlock, counted_grad_norm_sq, relative_error, sum_partial_grads_of_, tp_group_of_size

S, B, D, FFN = 8, 2, 4, 32
# (name, num_heads, num_kv_heads)
HEADS = [("mha", 4, 4), ("gqa4x2", 4, 2), ("gqa8x1", 8, 1)]
CASES = [(tp, sp, h) for tp in (1, 2, 4) for sp in (False, True) for h in HEADS]
CASES += [(2, True, HEADS[1]), (4, True, HEADS[2])]
OVERLAP_CASES = {len(CASES) - 2, len(CASES) - 1}  # these two with tp_comm_overlap (ring p2p collectives)


def case_id(i):
    tp, sp, (name, _, _) = CASES[i]
    return f"tp={tp}-{'sp' if sp else 'nosp'}-{name}" + ("-overlap" if i in OVERLAP_CASES else "")



def full_weights(hidden, hq, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    return {
        "norm1.weight": 1 + r(hidden), "norm1.bias": r(hidden), "norm2.weight": 1 + r(hidden), "norm2.bias": r(hidden),
        "wq": r(hq * D, hidden), "wk": r(hkv * D, hidden), "wv": r(hkv * D, hidden), "wo": r(hidden, hq * D),
        "w_gate": r(FFN, hidden), "w_up": r(FFN, hidden), "w_down": r(hidden, FFN),
    }


def reference_block(x, w, hq, hkv):
    """Single-device pre-norm block in plain torch (explicit softmax attention, GQA by index)."""
    hidden = x.shape[-1]
    a = F.layer_norm(x, (hidden,), w["norm1.weight"], w["norm1.bias"])
    q = (a @ w["wq"].T).view(S, B, hq, D)
    k = (a @ w["wk"].T).view(S, B, hkv, D)
    v = (a @ w["wv"].T).view(S, B, hkv, D)
    kv_of = torch.arange(hq) // (hq // hkv)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k[:, :, kv_of]) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v[:, :, kv_of]).reshape(S, B, hq * D)
    h = x + o @ w["wo"].T
    m = F.layer_norm(h, (hidden,), w["norm2.weight"], w["norm2.bias"])
    return h + (F.silu(m @ w["w_gate"].T) * (m @ w["w_up"].T)) @ w["w_down"].T


def local_shard_of(name, full, tp, r, hkv):
    """This rank's piece of a full tensor, by hand: heads-aware for wk/wv, replicated norms."""
    if name in ("wq", "w_gate", "w_up"):
        return full.chunk(tp, 0)[r]
    if name in ("wo", "w_down"):
        return full.chunk(tp, 1)[r]
    if name in ("wk", "wv"):
        heads = list(full.chunk(hkv, 0))
        if hkv >= tp:
            return torch.cat(heads[r * hkv // tp : (r + 1) * hkv // tp])
        return heads[r // (tp // hkv)]
    return full


def param_grads(block):
    a, m = block.attn, block.mlp
    return {
        "norm1.weight": block.norm1.weight, "norm1.bias": block.norm1.bias,
        "norm2.weight": block.norm2.weight, "norm2.bias": block.norm2.bias,
        "wq": a.wq.weight, "wk": a.wk.weight, "wv": a.wv.weight, "wo": a.wo.weight,
        "w_gate": m.gate.weight, "w_up": m.up.weight, "w_down": m.down.weight,
    }



def run_block_cases():
    torch.manual_seed(0)
    groups = {tp: tp_group_of_size(tp) for tp in (1, 2, 4)}
    results = {}
    for i, (tp, sp, (name, hq, hkv)) in enumerate(CASES):
        group, r = groups[tp], dist.get_rank(groups[tp])
        hidden = hq * D
        w = full_weights(hidden, hq, hkv, seed=i)
        gen = torch.Generator().manual_seed(100 + i)
        x_full = torch.randn(S, B, hidden, generator=gen)
        grad_out = torch.randn(S, B, hidden, generator=gen)

        xr = x_full.clone().requires_grad_(True)
        wr = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        ref = reference_block(xr, wr, hq, hkv)
        ref.backward(grad_out)

        block = TPTransformerBlock(hidden, hq, hkv, FFN, group, sequence_parallel=sp,
                                   comm_overlap=i in OVERLAP_CASES).load_full_(w)
        shard = (lambda t: t.chunk(tp, 0)[r]) if sp else (lambda t: t)
        x = shard(x_full).clone().requires_grad_(True)
        with CommRecorder() as fwd:
            out = block(x)
        with CommRecorder() as bwd:
            out.backward(shard(grad_out))
        sum_partial_grads_of_(block)

        # activation memory of the norm regions: bytes the norms save for backward (params excluded)
        saved = []
        param_ptrs = {q.data_ptr() for q in block.parameters()}
        def pack(t):
            if t.data_ptr() not in param_ptrs:
                saved.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block.norm1(x)

        errs = {"out": relative_error(out.detach(), shard(ref.detach())), "x.grad": relative_error(x.grad, shard(xr.grad))}
        for pname, param in param_grads(block).items():
            errs[pname] = relative_error(param.grad, local_shard_of(pname, wr[pname].grad, tp, r, hkv))
        # the grad-norm shares of the TP ranks add up to the single-device grad norm
        share = counted_grad_norm_sq(block)
        dist.all_reduce(share, group=group)
        errs["grad_norm_sq"] = relative_error(share, sum(t.grad.pow(2).sum() for t in wr.values()))
        record = lambda rec: [(c.op, c.group_size, c.bytes, c.wire_bytes) for c in rec.records]  # noqa: E731
        results[i] = {"errs": errs, "fwd": record(fwd), "bwd": record(bwd), "norm_saved": sum(saved),
                      "act_bytes": S * B * hidden * 4}
    return results


@pytest.fixture(scope="module")
def block_results(dist_run):
    per_rank = dist_run(4, run_block_cases)
    return per_rank


@pytest.mark.parametrize("i", range(len(CASES)), ids=case_id)
def test_block_matches_single_device(block_results, i):
    for rank, res in enumerate(block_results):
        worst = {k: v for k, v in res[i]["errs"].items() if not v <= 1e-5}
        assert not worst, f"rank {rank}: relative errors above 1e-5: {worst}"


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c[0] > 1], ids=case_id)
def test_block_collectives_and_bytes(block_results, i):
    tp, sp, _ = CASES[i]
    res = block_results[0][i]
    n = res["act_bytes"]  # one [S, B, H] fp32 activation
    if i in OVERLAP_CASES:
        # each of the 4 entries/exits (and their duals) is a ring of tp - 1 sends of one [S/tp, B, H] chunk
        for records in (res["fwd"], res["bwd"]):
            assert [(op, nbytes) for op, _, nbytes, _ in records] == [("send", n // tp)] * (4 * (tp - 1))
        assert sum(wire for *_, wire in res["fwd"] + res["bwd"]) == 4 * 2 * (tp - 1) * n // tp  # as the collectives
        return
    if sp:
        assert [op for op, *_ in res["fwd"]] == ["all_gather", "reduce_scatter"] * 2
        # reverse order: each exit's dual (all-gather) then each entry's dual (reduce-scatter)
        assert [op for op, *_ in res["bwd"]] == ["all_gather", "reduce_scatter"] * 2
    else:
        assert [op for op, *_ in res["fwd"]] == ["all_reduce"] * 2
        assert [op for op, *_ in res["bwd"]] == ["all_reduce"] * 2
    records = res["fwd"] + res["bwd"]
    assert all(size == tp and nbytes == n for _, size, nbytes, _ in records)
    # what goes on the wire per rank: 4 all-reduces of [S,B,H] == 4 (reduce-scatter + all-gather)
    assert sum(wire for *_, wire in records) == 4 * 2 * (tp - 1) * n // tp


def test_tp1_block_communicates_nothing(block_results):
    for i, (tp, _, _) in enumerate(CASES):
        if tp == 1:
            assert block_results[0][i]["fwd"] == [] and block_results[0][i]["bwd"] == []


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_norm_saves_s_over_tp_activations(block_results, tp):
    nosp = next(i for i, c in enumerate(CASES) if c[:2] == (tp, False))
    sp = next(i for i, c in enumerate(CASES) if c[:2] == (tp, True) and c[2] == CASES[nosp][2])
    full, split = block_results[0][nosp]["norm_saved"], block_results[0][sp]["norm_saved"]
    assert full >= block_results[0][nosp]["act_bytes"]  # at least its [S, B, H] input
    assert split * tp == full  # [S/tp, B, H] instead of [S, B, H]
