"""Dispatchers move each token once per rank it needs and return the input; capacity, grouping, aux-free balancing."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from par_groups import CommRecorder, RankGrid, create_groups, placement_of
from par_moe import GroupedSwiGLU, MoEConfig, MoELayer, capacity_keep, make_dispatcher
from par_moe.testing import ReferenceMoE
from par_moe.router import Router

H, E = 16, 64


def random_topk(tokens, k, gen):
    """Distinct experts per token, uniformly random."""
    return torch.rand(tokens, E, generator=gen).topk(k, dim=-1).indices


def roundtrip_job(tokens):
    """Per (ep, dispatcher, k): identity experts with unit weights give k * x exactly."""
    rank = dist.get_rank()
    out = {}
    for ep in (2, 4):
        pg = create_groups(RankGrid(dist.get_world_size(), ep=ep), timeout=timedelta(seconds=60))
        for kind in ("alltoall", "allgather"):
            for k in (1, 2, 8):
                gen = torch.Generator().manual_seed(100 * rank + k)
                # Values on a 1/16 grid, so summing k copies is exact in fp32 (3x may round otherwise).
                x = torch.randn(tokens, H, generator=gen) if k == 1 else (torch.randn(tokens, H, generator=gen) * 16).round() / 16
                indices = random_topk(tokens, k, gen)
                d = make_dispatcher(kind, E, pg.ep)
                with CommRecorder() as rec:
                    rows, counts, handle = d.dispatch(x, indices, torch.ones(tokens, k))
                    y = d.combine(rows, handle)
                # Every received row is a token routed to this rank's experts, grouped by expert.
                first = pg.rank_in("ep") * (E // ep)
                local_expert = torch.repeat_interleave(torch.arange(E // ep), counts)
                out[(ep, kind, k)] = dict(
                    exact=torch.equal(y, k * x), rows=rows, local_expert=local_expert + first,
                    x=x, indices=indices, sent=sum(r.wire_bytes for r in rec.records), ops=rec.ops())
    return out


def test_dispatch_then_combine_with_unit_weights_returns_the_input(dist_run):
    tokens = 12
    results = dist_run(4, roundtrip_job, tokens, timeout=600)
    for (ep, kind, k), _ in results[0].items():
        per_rank = [r[(ep, kind, k)] for r in results]
        assert all(r["exact"] for r in per_rank), (ep, kind, k)
        for rank, r in enumerate(per_rank):
            group = [g for g in RankGrid(4, ep=ep).expert_ranks("ep") if rank in g][0]
            # expected: every (token, expert) pair of the ep group whose expert lives on this rank
            mine = range(group.index(rank) * (E // ep), (group.index(rank) + 1) * (E // ep))
            expected = sorted((int(e), tuple(x.tolist()))
                              for src in group
                              for x, experts in zip(per_rank[src]["x"], per_rank[src]["indices"])
                              for e in experts if int(e) in mine)
            got = sorted((int(e), tuple(row.tolist())) for e, row in zip(r["local_expert"], r["rows"]))
            assert got == expected, (ep, kind, k, rank)
            if kind == "alltoall":
                # The minimum: each token once to each other rank holding any of its experts (with its k
                # slots' weights and ids: 2k columns), one row back per row received; plus the counts (to
                # each other rank: its rows and its pairs per local expert, int64, read once on the host).
                me = group.index(rank)
                ranks_of = [[{int(e) // (E // ep) for e in experts} for experts in per_rank[src]["indices"]] for src in group]
                rows_out = sum(len(dests - {me}) for dests in ranks_of[me])
                rows_in = sum(me in dests for i, src in enumerate(group) if i != me for dests in ranks_of[i])
                minimum = (ep - 1) * (1 + E // ep) * 8 + rows_out * (H + 2 * k) * 4 + rows_in * H * 4
                assert r["sent"] == minimum, (ep, k, rank, r["sent"], minimum)
                assert r["ops"] == ["all_to_all"] * 3


def test_capacity_matches_reference_policy():
    gen = torch.Generator().manual_seed(0)
    for policy in ("probs", "position"):
        for k, factor in ((1, 0.5), (2, 1.0), (8, 1.25), (2, 4.0)):
            config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=E, top_k=k, capacity_factor=factor, drop_policy=policy)
            tokens = 40
            indices = random_topk(tokens, k, gen)
            weights = torch.rand(tokens, k, generator=gen)
            ours = capacity_keep(indices, weights, E, config.capacity(tokens), policy)
            ref = ReferenceMoE(config).capacity_keep(indices, weights)
            assert torch.equal(ours, ref), (policy, k, factor)
            per_expert = torch.bincount(indices[ours], minlength=E)
            assert per_expert.max() <= config.capacity(tokens)


def test_group_limited_routing_reaches_at_most_topk_groups():
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=E, top_k=8, score_func="sigmoid", n_groups=8, topk_groups=2)
    routing = Router(config)(torch.randn(50, H))
    groups_per_token = [(len(set((row // 8).tolist()))) for row in routing.indices]
    assert max(groups_per_token) <= 2 and len(set(map(tuple, routing.indices.tolist()))) > 1
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(50))  # normalized, scale 1


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_tied_scores_go_to_the_lower_expert_index(score_func):
    """Experts 3, 9 and 40 score alike for every token (equal router rows, scores tied to the bit):
    the router and the reference both pick, among tied experts, the lowest indices first; so any
    layout (whatever topk's kernel would do with ties on its tensor sizes) routes a tie alike."""
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=E, top_k=2, score_func=score_func)
    router, ref = Router(config), ReferenceMoE(config)
    with torch.no_grad():
        router.weight.mul_(0.01)  # the tied three score well above the rest
        router.weight[[3, 9, 40]] = torch.ones(H)
        ref.router.weight.copy_(router.weight)
    x = torch.rand(7, H) + 0.5
    assert router(x).indices.tolist() == [[3, 9]] * 7
    assert ref.route(x)[2].tolist() == [[3, 9]] * 7


def test_the_routing_keeps_each_tokens_top_k_not_the_whole_order():
    """The chosen experts, kept with the routing until the backward (and replayed by a recompute), hold
    ``[T, top_k]`` indices: not a view of the sort's ``[T, E]`` order, whose storage it would keep alive."""
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=E, top_k=2)
    indices = Router(config)(torch.randn(50, H)).indices
    assert indices.shape == (50, 2) and indices.untyped_storage().nbytes() == 50 * 2 * indices.element_size()


def test_grouped_gemm_matches_batched_fallback_in_bf16():
    experts = GroupedSwiGLU(4, 16, 32)
    counts = torch.tensor([5, 0, 9, 2])
    tokens = torch.randn(16, 16)
    want = experts(tokens, counts)  # fp32: the batched fallback
    per_expert = torch.cat([experts.w_down[e] @ (torch.nn.functional.silu(experts.w_gate[e] @ t.T) * (experts.w_up[e] @ t.T))
                            for e, t in enumerate(tokens.split(counts.tolist()))], dim=1).T
    torch.testing.assert_close(want, per_expert, atol=1e-5, rtol=1e-5)
    experts = experts.to(torch.bfloat16)
    try:
        got = experts(tokens.bfloat16(), counts)
    except RuntimeError as err:  # pragma: no cover - depends on the torch build
        pytest.skip(f"grouped_mm unavailable: {err}")
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("bad", [dict(top_k=65), dict(score_func="relu"), dict(n_groups=3), dict(n_groups=8, topk_groups=9),
                                 dict(capacity_factor=0.0), dict(dispatcher="deepep"), dict(top_k=3, n_groups=8, topk_groups=2, group_score="top_k_per_group"),
                                 dict(group_score="top3")])
def test_config_rejects_invalid_values(bad):
    kwargs = dict(hidden=H, ffn_hidden=8, num_experts=E, top_k=2) | bad
    with pytest.raises(ValueError):
        MoEConfig(**kwargs)


def skewed_balance_job(steps):
    """Sigmoid router whose first 4 experts win for every token; bias updates over the world."""
    pg = create_groups(RankGrid(dist.get_world_size(), ep=2), timeout=timedelta(seconds=60))
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=16, top_k=2, score_func="sigmoid", bias_update_rate=0.01)
    layer = MoELayer.from_reference(ReferenceMoE(config, seed=0), pg.ep, pg.etp)
    direction = torch.nn.functional.normalize(torch.ones(H), dim=0)
    with torch.no_grad():
        layer.router.weight[:4] += 2 * direction
    gen = torch.Generator().manual_seed(dist.get_rank())
    imbalance, hot_share, local_sums = [], [], []
    for _ in range(steps):
        x = torch.randn(64, H, generator=gen) + 2 * direction
        with torch.no_grad():
            layer(x)
        local = layer.routed_since_update.clone()
        load = layer.update_bias(dist.group.WORLD)
        local_sums.append((local, load))
        imbalance.append((load.max() / load.mean()).item())
        hot_share.append((load[:4].sum() / load.sum()).item())
    return imbalance, hot_share, layer.router.expert_bias.clone(), local_sums[0]


def test_aux_free_bias_lowers_imbalance_of_a_skewed_router(dist_run):
    results = dist_run(4, skewed_balance_job, 60, timeout=600)
    imbalance, hot_share, bias0, _ = results[0]
    for _, _, bias, _ in results[1:]:
        assert torch.equal(bias, bias0)  # every rank applied the same update
    assert sum(r[3][0] for r in results).tolist() == results[0][3][1].tolist()  # load = counts summed over ranks
    assert imbalance[0] > 3.0 and hot_share[0] > 0.9, (imbalance[:3], hot_share[:3])  # 4 hot experts of 16 take all
    late_imbalance, late_share = sum(imbalance[-10:]) / 10, sum(hot_share[-10:]) / 10
    assert late_imbalance < 0.5 * imbalance[0], (imbalance[0], late_imbalance)
    assert late_share < 0.5, late_share  # fair share would be 0.25


def test_metrics_count_routed_pairs_and_drops_on_flat_tokens():
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=E, top_k=2, capacity_factor=0.5, drop_policy="probs",
                       aux_loss_coeff=0.01, z_loss_coeff=0.001)
    ref = ReferenceMoE(config, seed=3)
    layer = MoELayer.from_reference(ref)
    x = torch.randn(40, H)  # [T, H] input works as well as [S, B, H]
    y, aux = layer(x)
    y_ref, aux_ref = ref(x)
    torch.testing.assert_close(y, y_ref, atol=2e-5, rtol=1e-4)
    m = layer.last_metrics
    _, _, chosen, weights = ref.route(x)
    keep = ref.capacity_keep(chosen, weights)
    assert torch.equal(m["tokens_per_expert"], torch.bincount(chosen.reshape(-1), minlength=E))
    assert m["dropped_fraction"].item() == pytest.approx(1 - keep.float().mean().item())
    assert m["imbalance"].item() == pytest.approx((m["tokens_per_expert"].max() / m["tokens_per_expert"].float().mean()).item())
    assert m["aux_loss"].item() > 0 and m["z_loss"].item() > 0
    assert (m["aux_loss"] + m["z_loss"]).item() == pytest.approx(aux.item())
    assert all(placement_of(p).expert for p in layer.experts.parameters())
    assert not any(placement_of(p).expert for p in layer.router.parameters())
