"""par-moe's router, balance losses, capacity and expert-bias update against megatron-core's ``moe_utils``.

An outside oracle: megatron-core (a dev dependency of the workspace, never imported by par-moe's
sources) runs on the CPU. Every value is compared at 1e-6 (fp32). Where the two define a quantity
differently the mapping is stated at the test that meets it:

* Megatron's balance losses recount a plain top-k of the unbiased scores
  (``compute_routing_scores_for_aux_loss``); par-moe counts the pairs it routes (after the expert
  bias and the group limit). The layer test has zero bias and one group, where the two coincide;
  the loss functions themselves are compared on the same counts.
* The sequence-wise loss is glue in Megatron's ``TopKRouter._apply_seq_aux_loss`` (which needs CUDA
  to build): the ``[S*B, E]`` scores viewed as ``[S, B*E]``, ``switch_load_balancing_loss_func``
  over S tokens, divided by B. :func:`megatron_seq_aux_loss` is that glue, the math megatron's.
* ``get_updated_expert_bias`` all-reduces over ``parallel_state``'s tp-dp-cp group; the test runs it
  on two ranks with that group patched to the world.
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils as mm

from par_moe import MoEConfig, MoELayer, capacity_keep
from par_moe import losses
from par_moe.router import Router

TOL = dict(rtol=1e-6, atol=1e-6)
H = 16


def dense(indices: torch.Tensor, values: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] choices and their values -> [T, E], zero where not chosen (Megatron's layout)."""
    return torch.zeros(indices.shape[0], num_experts, dtype=values.dtype).scatter(1, indices, values)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


# ---- the router: topk_routing_with_score_function ------------------------------------------------

# (par-moe config, Megatron keyword arguments, expert bias scale). Mappings: Megatron's group score is
# the sum of the top top_k/group_topk scores, par-moe's "top_k_per_group" ("top2" when that is 2).
# Megatron applies the expert bias to sigmoid scores only: softmax cases have zero bias. Megatron's
# "pre-softmax" weights are the chosen softmax scores (par-moe normalize_topk=False); without it they
# are the softmax of the chosen logits, i.e. the chosen scores normalized (normalize_topk=True; Megatron
# then ranks groups by logits, so no groups there). Megatron does not normalize one sigmoid weight
# (top_k=1), par-moe does unless normalize_topk=False.
ROUTER_CASES = {
    "sigmoid-groups-bias": (dict(score_func="sigmoid", num_experts=16, top_k=4, n_groups=4, topk_groups=2,
                                 group_score="top_k_per_group", routed_scaling_factor=2.5),
                            dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5), 0.05),
    "sigmoid-top2-groups-bias": (dict(score_func="sigmoid", num_experts=32, top_k=8, n_groups=8, topk_groups=4,
                                      group_score="top2"),
                                 dict(score_function="sigmoid", num_groups=8, group_topk=4), 0.05),
    "sigmoid-bias-top1": (dict(score_func="sigmoid", num_experts=8, top_k=1, normalize_topk=False),
                          dict(score_function="sigmoid"), 0.05),
    "softmax-pre-groups": (dict(score_func="softmax", num_experts=16, top_k=3, n_groups=4, topk_groups=1,
                                group_score="top_k_per_group", normalize_topk=False),
                           dict(score_function="softmax", use_pre_softmax=True, num_groups=4, group_topk=1), 0.0),
    "softmax-post": (dict(score_func="softmax", num_experts=8, top_k=2, normalize_topk=True, routed_scaling_factor=1.5),
                     dict(score_function="softmax", use_pre_softmax=False, scaling_factor=1.5), 0.0),
}


def megatron_routing(logits, config: MoEConfig, kwargs, expert_bias):
    bias = expert_bias if kwargs["score_function"] == "sigmoid" else None
    return mm.topk_routing_with_score_function(logits, config.top_k, expert_bias=bias, **kwargs)


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_matches_megatron_topk_routing(case):
    fields, kwargs, bias_scale = ROUTER_CASES[case]
    config = MoEConfig(hidden=H, ffn_hidden=8, **fields)
    torch.manual_seed(0)
    router = Router(config)
    router.expert_bias.copy_(torch.randn(config.num_experts, generator=torch.Generator().manual_seed(1)) * bias_scale)
    routing = router(tokens(64, seed=2))
    logits = routing.logits.detach()
    probs, routing_map = megatron_routing(logits, config, kwargs, router.expert_bias)

    assert torch.equal(dense(routing.indices, torch.ones_like(routing.weights, dtype=torch.bool), config.num_experts),
                       routing_map)
    torch.testing.assert_close(dense(routing.indices, routing.weights.detach(), config.num_experts), probs, **TOL)
    # the case exercises what it names: the bias and the group limit each change some token's experts
    plain = mm.topk_routing_with_score_function(logits, config.top_k, score_function=kwargs["score_function"],
                                                use_pre_softmax=True)[1]
    if bias_scale:
        unbiased = megatron_routing(logits, config, kwargs, torch.zeros_like(router.expert_bias))[1]
        assert not torch.equal(unbiased, routing_map)
    if config.n_groups > 1:
        assert not torch.equal(plain, megatron_routing(logits, config, kwargs, torch.zeros(config.num_experts))[1])


# ---- the balance losses ----------------------------------------------------------------------------


def test_switch_aux_loss_matches_megatron_on_the_same_counts():
    g = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, coeff = 40, 8, 2, 0.01
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=g), -1).requires_grad_()
    counts = torch.randint(0, 20, (num_experts,), generator=g)
    ours = losses.switch_aux_loss(probs, counts, num_tokens, top_k, coeff)
    theirs = mm.switch_load_balancing_loss_func(probs, counts, num_tokens, top_k, num_experts, coeff)
    torch.testing.assert_close(ours, theirs, **TOL)
    grads = [torch.autograd.grad(loss, probs)[0] for loss in (ours, theirs)]
    torch.testing.assert_close(*grads, **TOL)


def megatron_seq_aux_loss(scores, routing_map, seq_len, batch, top_k, num_experts, coeff):
    """Megatron's ``TopKRouter._apply_seq_aux_loss`` on one rank, without padding."""
    scores, routing_map = scores.reshape(seq_len, -1), routing_map.reshape(seq_len, -1)
    return mm.switch_load_balancing_loss_func(scores, routing_map.sum(0), seq_len, top_k, num_experts, coeff) / batch


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_layer_losses_and_their_gradients_match_megatron(score_func):
    """MoELayer's aux, sequence-aux and z losses (zero bias, one group: the counts coincide)."""
    seq, batch = 6, 3
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=8, top_k=2, score_func=score_func,
                       aux_loss_coeff=0.01, seq_aux_loss_coeff=0.003, z_loss_coeff=0.002)
    torch.manual_seed(4)
    layer = MoELayer(config)
    x = tokens(seq * batch, seed=5).view(seq, batch, H)
    _, aux = layer(x)
    ours = layer.last_metrics
    (ours_grad,) = torch.autograd.grad(aux, layer.router.weight)

    weight = layer.router.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, H) @ weight.T
    routing_map, scores = mm.compute_routing_scores_for_aux_loss(logits, config.top_k, score_func)
    theirs = {
        "aux_loss": mm.switch_load_balancing_loss_func(scores, routing_map.sum(0), seq * batch, config.top_k,
                                                       config.num_experts, config.aux_loss_coeff),
        "seq_aux_loss": megatron_seq_aux_loss(scores, routing_map, seq, batch, config.top_k, config.num_experts,
                                              config.seq_aux_loss_coeff),
        "z_loss": mm.z_loss_func(logits, config.z_loss_coeff),
    }
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value.detach(), **TOL, msg=name)
    (theirs_grad,) = torch.autograd.grad(sum(theirs.values()), weight)
    torch.testing.assert_close(ours_grad, theirs_grad, **TOL)
    # the sequences differ: a loss averaged over the batch is not the whole batch's loss
    assert not torch.allclose(theirs["seq_aux_loss"], theirs["aux_loss"] * config.seq_aux_loss_coeff / config.aux_loss_coeff)


# ---- capacity --------------------------------------------------------------------------------------


def test_capacity_matches_megatron_get_capacity():
    for num_tokens in (1, 7, 12, 100, 333):
        for top_k, num_experts in ((1, 4), (2, 8), (3, 16), (8, 64)):
            for factor in (0.3, 0.5, 1.0, 1.1, 1.25, 2.0):
                config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=num_experts, top_k=top_k, capacity_factor=factor)
                assert config.capacity(num_tokens) == mm.get_capacity(num_tokens * top_k, num_experts, factor), \
                    (num_tokens, top_k, num_experts, factor)


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0])  # capacity 4, 7, 13 of 50 x 2 / 8 = 12.5
def test_capacity_drop_matches_megatron_token_dropping(factor):
    """The "probs" policy only: Megatron's "position" takes a torch.topk of the 0/1 routing map, whose
    choice among the tied ones is not token order on the CPU."""
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=8, top_k=2, capacity_factor=factor, drop_policy="probs")
    torch.manual_seed(6)
    routing = Router(config)(tokens(50, seed=7))
    weights = routing.weights.detach()
    keep = capacity_keep(routing.indices, weights, config.num_experts, config.capacity(50), "probs")
    probs = dense(routing.indices, weights, config.num_experts)
    final_probs, final_map = mm.apply_router_token_dropping(probs, probs > 0, config.top_k, factor, "probs")
    assert not keep.all()  # something is dropped
    assert torch.equal(dense(routing.indices, keep, config.num_experts), final_map)
    torch.testing.assert_close(dense(routing.indices, weights * keep, config.num_experts), final_probs, **TOL)


# ---- the expert-bias update ------------------------------------------------------------------------


def bias_update_on_ranks():
    """Two training micro-batches per rank (different tokens), then par-moe's and Megatron's update."""
    rank = dist.get_rank()
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=16, top_k=4, score_func="sigmoid", n_groups=4,
                       topk_groups=2, bias_update_rate=1e-3)
    torch.manual_seed(8)
    layer = MoELayer(config)
    start = torch.randn(config.num_experts, generator=torch.Generator().manual_seed(9)) * 0.01
    layer.router.expert_bias.copy_(start)
    routed = torch.zeros(config.num_experts)  # Megatron's local_tokens_per_expert (fp32)
    for micro in range(2):
        x = tokens(24, seed=10 + 2 * rank + micro)
        layer(x)
        logits = layer.router(x).logits.detach()
        routed += mm.topk_routing_with_score_function(logits, config.top_k, num_groups=4, group_topk=2,
                                                      score_function="sigmoid", expert_bias=start)[1].sum(0)
    layer.update_bias(dist.group.WORLD)
    with mock.patch.object(parallel_state, "get_tensor_and_data_parallel_group", return_value=dist.group.WORLD):
        theirs = mm.get_updated_expert_bias(routed, start, config.bias_update_rate)
    return {"ours": layer.router.expert_bias.clone(), "theirs": theirs, "start": start}


def test_bias_update_matches_megatron_get_updated_expert_bias(dist_run):
    for r in dist_run(2, bias_update_on_ranks):
        torch.testing.assert_close(r["ours"], r["theirs"], **TOL)
        step = r["ours"] - r["start"]
        assert (step > 0).any() and (step < 0).any()  # both directions occur
