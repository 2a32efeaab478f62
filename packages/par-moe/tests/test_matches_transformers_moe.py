"""MoELayer against transformers' own MoE code, an oracle outside this package.

* Softmax top-k with the switch load-balancing loss = Mixtral's sparse block with its
  ``load_balancing_loss_func``: outputs, the aux loss, and the gradients of (output . cotangent +
  aux) for input, router and experts, on one rank and with the tokens and experts split over ep = 2.
  (Mixtral's loss has f_i = count_i / T where ours, like Megatron's, has count_i / (k T):
  ours with coefficient a equals a / k times transformers'.)
* The sigmoid, group-limited router with a selection-only bias = DeepSeek-V3's router (a group
  scored by its top 2): the same experts and the same combine weights, also where top_k is not
  2 * topk_group or topk_group does not divide it (there the paper's rule, "top_k_per_group",
  picks other experts: checked, so this test tells the two apart).
"""

from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from par_groups import RankGrid, create_groups
from par_moe import MoEConfig, MoELayer

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func  # noqa: E402

S, B, H, F, E, K, ALPHA = 8, 4, 16, 8, 8, 2, 0.1


def assert_close(got, want, what):
    """Max abs error <= 1e-6 of the tensor's max (fp32, other summation orders: measured <= 3.4e-7)."""
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert got.shape == want.shape and err <= 1e-6 * scale, f"{what}: max error {err:.3g} vs max {scale:.3g}"


def mixtral_block():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return block


def inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


def transformers_grads():
    """Mixtral's block on every token ([B, S, H] there); loss = output . cotangent + ALPHA/K * its aux."""
    block = mixtral_block()
    x, cotangent = inputs()
    hidden = x.permute(1, 0, 2).contiguous().requires_grad_(True)
    y = block(hidden)
    router_logits, _, _ = block.gate(hidden)
    aux = ALPHA / K * load_balancing_loss_func((router_logits,), E, K)
    ((y * cotangent.permute(1, 0, 2)).sum() + aux).backward()
    gate_up = block.experts.gate_up_proj.grad
    return {"y": y.detach().permute(1, 0, 2), "dx": hidden.grad.permute(1, 0, 2), "aux": aux.detach(),
            "router": block.gate.weight.grad, "w_gate": gate_up[:, :F], "w_up": gate_up[:, F:],
            "w_down": block.experts.down_proj.grad}


def our_layer_grads():
    """This rank's sequences (the batch split over the ep ranks) through MoELayer with Mixtral's weights."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = create_groups(RankGrid(world, ep=world, etp=1), timeout=timedelta(seconds=60))
    config = MoEConfig(hidden=H, ffn_hidden=F, num_experts=E, top_k=K, normalize_topk=True, aux_loss_coeff=ALPHA)
    layer = MoELayer(config, groups.ep, groups.etp, aux_group=groups.dp)
    block = mixtral_block()
    gate_up = block.experts.gate_up_proj.detach()
    layer.load_full_(block.gate.weight.detach(), gate_up[:, :F], gate_up[:, F:], block.experts.down_proj.detach())
    x, cotangent = inputs()
    mine = slice(rank * B // world, (rank + 1) * B // world)
    x = x[:, mine].clone().requires_grad_(True)
    y, aux = layer(x)
    ((y * cotangent[:, mine]).sum() + aux).backward()
    return {"y": y.detach(), "dx": x.grad, "aux": aux.detach(), "router": layer.router.weight.grad,
            "experts": (layer.first_expert, layer.num_local_experts),
            **{n: getattr(layer.experts, n).grad for n in ("w_gate", "w_up", "w_down")}}


@pytest.mark.parametrize("ep", [1, 2])
def test_softmax_topk_layer_with_aux_loss_matches_mixtral(dist_run, ep):
    want = transformers_grads()
    got = dist_run(ep, our_layer_grads)
    for name in ("y", "dx"):  # each rank's sequences
        assert_close(torch.cat([r[name] for r in got], dim=1), want[name], name)
    assert_close(sum(r["aux"] for r in got), want["aux"], "aux loss")  # the shares sum to the loss
    assert_close(sum(r["router"] for r in got), want["router"], "router grad")
    for name in ("w_gate", "w_up", "w_down"):  # each rank holds its experts' full gradient
        full = torch.cat([r[name] for r in sorted(got, key=lambda r: r["experts"][0])])
        assert_close(full, want[name], f"{name} grad")
    assert want["aux"] > 0 and want["router"].abs().max() > 1e-3


@pytest.mark.parametrize("top_k,topk_groups", [(4, 2), (6, 2), (3, 2), (2, 3)])
def test_sigmoid_group_limited_router_matches_deepseek_v3(top_k, topk_groups):
    from par_moe.router import Router

    experts, n_groups, hidden, tokens = 16, 4, 16, 64
    config = transformers.DeepseekV3Config(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k,
                                           n_group=n_groups, topk_group=topk_groups, norm_topk_prob=True,
                                           routed_scaling_factor=2.5)
    theirs = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(experts, hidden) * hidden ** -0.5)
        theirs.e_score_correction_bias.copy_(torch.randn(experts) * 0.1)  # moves selection, not the weights
    ours = Router(MoEConfig(hidden=hidden, ffn_hidden=8, num_experts=experts, top_k=top_k, score_func="sigmoid",
                            n_groups=n_groups, topk_groups=topk_groups, routed_scaling_factor=2.5))
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(tokens, hidden)
    _, their_weights, their_indices = theirs(x)
    routing = ours(x)
    their_order, our_order = their_indices.sort(-1), routing.indices.sort(-1)
    assert torch.equal(our_order.values, their_order.values)  # the same experts for every token
    assert_close(routing.weights.gather(1, our_order.indices), their_weights.gather(1, their_order.indices), "weights")
    reached = torch.stack([(routing.indices // (experts // n_groups) == g).any(-1) for g in range(n_groups)], -1)
    limit = min(topk_groups, top_k)
    assert (reached.sum(-1) <= limit).all() and (reached.sum(-1) == limit).any()
    unbiased = torch.sigmoid(x @ theirs.weight.T).topk(top_k, -1).indices.sort(-1).values
    assert not torch.equal(unbiased, our_order.values)  # the bias and group limit changed some choices
    if top_k != 2 * topk_groups and top_k % topk_groups == 0:
        paper = Router(replace(ours.config, group_score="top_k_per_group"))
        paper.load_state_dict(ours.state_dict())
        assert not torch.equal(paper(x).indices.sort(-1).values, our_order.values)
