"""Qwen3-Next's Gated DeltaNet layer under every CP kind equals the layer on one rank (output and input
gradient, fp32 <= 1e-5 relative): p2p at cp 2 and 4 (the state pass and the conv's halo,
``par_cp.state_passing``), a2a at cp 4 (the key heads split over the ranks: one all-to-all in, the conv
and the rule over the whole sequence, one back), and a2a+p2p with hcp [2, 2] (the all-to-all in the inner
pairs, the state pass over the outer ring), packed documents at cp 4 (20 training steps of each kind,
unpacked too: tests/test_layouts_qwen3_next.py, opt-in). Under p2p the bytes a rank sends, forward and
backward, are what ``plan`` declares per linear layer (``Qwen3Next.recurrent_state``): one state of
value heads x linear_key_dim x linear_value_dim per boundary with another rank's piece, and the conv's
halo of conv_kernel - 1 tokens of the conv's channels."""

from types import SimpleNamespace

import pytest

S, B = 32, 2
TOL = 1e-5
MODEL = ["model.attention=qwen3_next", "model.full_attention_interval=2", "model.heads=4", "model.kv_heads=2",
         "model.linear_key_heads=4", "model.linear_value_heads=8", "model.linear_key_dim=8", "model.linear_value_dim=4"]
DOCS = ((0, 3, 8, 19, 32), (0, 12, 13, 32))  # 8 starts a piece at cp 2 and cp 4
CASES = [(2, "p2p", None, None), (4, "p2p", None, DOCS), (4, "a2a", None, DOCS), (4, "a2a+p2p", (2, 2), DOCS)]


def _layer(model, groups, mode, recompute="none"):
    import torch

    from pretrain.blocks.context import ChunkContext
    from pretrain.models.qwen3_next.gdn import TPGatedDeltaNet

    layer = TPGatedDeltaNet(model, ChunkContext(groups, False, mode, S, recompute))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(layer.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def layer_job(cases):
    """Per case: this rank's errors against one rank, and the (op, bytes) it sent forward and backward."""
    import torch
    import torch.distributed as dist

    from par_cp import shard_sequence
    from par_groups import CommRecorder, RankGrid, create_groups
    from pretrain.config import load_config
    from pretrain.data.packing import Documents

    model = load_config(None, MODEL).model
    gen = torch.Generator().manual_seed(1)
    x, d_out = torch.randn(S, B, model.hidden, generator=gen), torch.randn(S, B, model.hidden, generator=gen)
    one = create_groups(RankGrid(dist.get_world_size()))
    refs = {}
    for docs in {c[3] for c in cases}:
        xf = x.clone().requires_grad_()
        out = _layer(model, one, "p2p")(xf, None if docs is None else Documents(docs, None))
        out.backward(d_out)
        refs[docs] = out.detach(), xf.grad

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    results, grids = [], {}
    for cp, mode, hcp, docs in cases:
        if (cp, hcp) not in grids:
            grids[(cp, hcp)] = create_groups(RankGrid(dist.get_world_size(), cp=cp, hcp=hcp))
        groups = grids[(cp, hcp)]
        rank = groups.rank_in("cp")
        xl = shard_sequence(x, rank, cp).requires_grad_()
        layer = _layer(model, groups, mode)
        with CommRecorder() as fwd:
            out = layer(xl, None if docs is None else Documents(docs, None))
        with CommRecorder() as bwd:
            out.backward(shard_sequence(d_out, rank, cp))
        ref, ref_grad = refs[docs]
        errors = {"out": rel(out.detach(), shard_sequence(ref, rank, cp)),
                  "dx": rel(xl.grad, shard_sequence(ref_grad, rank, cp))}
        results.append((errors, [(r.op, r.bytes) for r in fwd.records], [(r.op, r.bytes) for r in bwd.records]))
    return results


@pytest.fixture(scope="module")
def results(dist_run):
    per_rank = dist_run(4, layer_job, CASES, timeout=300)
    return {case: [r[i] for r in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[f"cp{c}-{m}{'-hcp' if h else ''}{'-packed' if d else ''}"
                                             for c, m, h, d in CASES])
def test_gdn_layer_under_cp_equals_one_rank(results, case):
    for rank, (errors, _, _) in enumerate(results[case]):
        assert max(errors.values()) <= TOL, (case, rank, errors)


@pytest.mark.parametrize("cp", [2, 4])
def test_p2p_bytes_per_layer_are_the_plan_formula(results, cp):
    """Each rank sends, per boundary with another rank's piece (zigzag: 1 at the ends, 2 inside),
    one fp32 state and one halo forward, and their gradients backward: nothing else."""
    from pretrain.config import load_config
    from pretrain.models import family_of

    model = load_config(None, MODEL).model
    layout = SimpleNamespace(tp=1, cp=cp, pp=1, microbatches=1, hcp=())
    declared = family_of(model).recurrent_state(model, layout, B)
    state = B * model.linear_value_heads * model.linear_key_dim * model.linear_value_dim * 4
    halo = B * (model.conv_kernel - 1) * (2 * model.linear_key_heads * model.linear_key_dim
                                          + model.linear_value_heads * model.linear_value_dim) * 4
    case = next(c for c in CASES if c[0] == cp and c[1] == "p2p")
    for rank, (_, fwd, bwd) in enumerate(results[case]):
        n = 1 if cp == 2 or rank in (0, cp - 1) else 2
        assert sorted(fwd) == sorted(bwd) == sorted([("send", state)] * n + [("send", halo)] * n), (rank, fwd, bwd)
        if n == declared["cp_boundaries_per_rank"]:  # the plan sizes the busiest rank
            assert sum(b for _, b in fwd + bwd) == declared["cp_state_bytes_per_layer"] + declared["cp_halo_bytes_per_layer"]


@pytest.mark.parametrize("mode, hcp, ops", [("a2a", None, ["all_to_all", "all_to_all"]),
                                            ("a2a+p2p", (2, 2), ["all_to_all", "send", "send", "all_to_all"])])
def test_all_to_all_kinds_split_the_key_heads(results, mode, hcp, ops):
    """a2a moves the projections in and the rule's output back, no state; a2a+p2p passes the state
    (and the conv's halo) over the outer ring between its two all-to-alls: the bytes ``plan`` declares
    (``recurrent_state`` of the kind: an all-to-all sends (P-1)/P of its input)."""
    from pretrain.config import load_config
    from pretrain.models import family_of

    model = load_config(None, MODEL).model
    for case in (c for c in CASES if c[1] == mode):
        layout = SimpleNamespace(tp=1, cp=case[0], pp=1, microbatches=1, hcp=hcp or ())
        declared = family_of(model).recurrent_state(model, layout, B, 4, mode)
        a2a = hcp[0] if hcp else case[0]
        for rank, (_, fwd, bwd) in enumerate(results[case]):
            assert [op for op, _ in fwd] == ops and [op for op, _ in bwd] == ops, (case, rank, fwd, bwd)
            sent = sum(n for op, n in fwd + bwd if op == "all_to_all") * (a2a - 1) / a2a
            assert sent == declared["cp_a2a_bytes_per_token"] * S // case[0] * B, (case, rank)
            assert sum(n for op, n in fwd + bwd if op == "send") == declared["cp_state_bytes_per_layer"] + declared[
                "cp_halo_bytes_per_layer"], (case, rank)


def saved_job(cp, seq, recomputes):
    """Bytes a bf16 forward of the layer saves for backward on this rank (parameters aside), on one rank
    and at ``cp`` (p2p), under each ``[model].recompute`` of ``recomputes``."""
    import torch
    import torch.distributed as dist

    from par_cp import shard_sequence
    from par_groups import RankGrid, create_groups
    from pretrain.config import load_config

    model = load_config(None, MODEL).model
    x = torch.randn(seq, B, model.hidden, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    out = {}
    for c in (1, cp):
        groups = create_groups(RankGrid(dist.get_world_size(), cp=c))
        for recompute in recomputes:
            layer = _layer(model, groups, "p2p", recompute).to(torch.bfloat16)
            layer.seq_len = seq
            params, seen = {p.untyped_storage().data_ptr() for p in layer.parameters()}, {}

            def pack(t):
                if t.untyped_storage().data_ptr() not in params:
                    seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                layer(shard_sequence(x, groups.rank_in("cp"), c).requires_grad_())
            out[(c, recompute)] = sum(seen.values())
    return out


def test_saved_bytes_are_the_family_declaration(dist_run):
    """What ``plan`` declares a Gated DeltaNet layer keeps for backward (``qwen3_next/memory.py``) is what a
    bf16 forward saves: on one rank, and on the busiest rank at cp 2 (both its pieces take the affine
    form), with its pieces' transitions and incoming states (``recurrent_state``). Within 0.1 %: a few
    per-layer constants (the causal mask, the chunks' end decays) are not declared. With its core
    recomputed (``core_attn``) the layer keeps the checkpoint's inputs and the output side, at any cp."""
    from pretrain.config import load_config
    from pretrain.models import family_of
    from pretrain.models.qwen3_next.memory import gdn_saved_per_token

    model, seq = load_config(None, MODEL).model, 512
    per_rank = dist_run(4, saved_job, 2, seq, ("none", "selective"), timeout=300)
    one = gdn_saved_per_token(model, 1, 1, 2, B) * seq * B
    pieces = family_of(model).recurrent_state(model, SimpleNamespace(tp=1, cp=2, pp=1, microbatches=1, hcp=()), B)
    cp2 = gdn_saved_per_token(model, 1, 2, 2, B) * seq // 2 * B + pieces["saved_bytes_per_layer"]
    assert per_rank[0][(1, "none")] == pytest.approx(one, rel=1e-3)
    assert max(r[(2, "none")] for r in per_rank) == pytest.approx(cp2, rel=1e-3), per_rank
    kept = gdn_saved_per_token(model, 1, 2, 2, B, "selective")  # the same at any cp: nothing of the core
    assert per_rank[0][(1, "selective")] == kept * seq * B, per_rank
    assert {r[(2, "selective")] for r in per_rank} == {kept * seq // 2 * B}, per_rank
