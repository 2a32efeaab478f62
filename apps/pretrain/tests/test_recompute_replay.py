"""A recomputed region reruns its forward as the first run drew it (blocks/recompute.py): the MoE routing
replayed whatever the rerun's router scores say, the dropout masks at the first run's place in the batch,
torch's RNG as it was; the policy's words and items read as documented."""

import pytest
import torch

from par_moe import MoEConfig, MoELayer

from pretrain.config import load_config
from pretrain.errors import UsageError
from pretrain.blocks import dropout
from pretrain.blocks.recompute import checkpointed
from pretrain.blocks.recompute_policy import modules_at


def _grads(layer, x, recompute: bool, between=lambda: None):
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y, aux = checkpointed(layer, x) if recompute else layer(x)
    between()  # what changes between the forward and the backward's rerun
    ((y * torch.arange(y.numel()).view_as(y).sin()).sum() + aux).backward()
    return [x.grad] + [p.grad for p in layer.parameters()]


def test_a_recomputed_moe_layer_routes_as_its_first_run_even_if_the_rerun_scores_differ():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden=16, ffn_hidden=32, num_experts=8, top_k=2, aux_loss_coeff=0.01,
                               bias_update_rate=0.1))
    x = torch.randn(24, 16)
    reference = _grads(layer, x, recompute=False)
    bias = layer.router.expert_bias

    def other_scores():  # the rerun's router would pick other experts for most tokens
        bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)) * 10)

    layer.routed_since_update.zero_()
    got = _grads(layer, x, recompute=True, between=other_scores)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    counted = layer.routed_since_update.sum().item()
    assert counted == 24 * 2  # the rerun's pairs are not counted again


def test_a_recomputed_region_draws_the_first_runs_dropout_masks_and_rng():
    place = dropout.DropoutPosition()

    def noisy(x):
        keep = dropout.keep_mask(tuple(x.shape), 0.5, place.at, 0, 0, x.device)
        return (x * keep * torch.rand_like(x)).tanh()

    x = torch.randn(8, 2, 4)
    place.set(7, 3, 16)
    torch.manual_seed(5)
    eager = x.clone().requires_grad_()
    noisy(eager).sum().backward()
    torch.manual_seed(5)
    ckpt = x.clone().requires_grad_()
    y = checkpointed(noisy, ckpt, dropout=place)
    place.set(7, 4, 24)  # the next micro-batch's forward ran before this one's backward
    torch.rand(100)
    y.sum().backward()
    assert torch.equal(ckpt.grad, eager.grad)
    assert place.at == (7, 4, 24)  # the rerun put the caller's place back


def test_policy_words_and_items():
    assert modules_at("selective", 3) == {"core_attn"} and modules_at("none", 0) == set()
    policy = ("core_attn", "mlp@0-1", "full@3")
    assert [sorted(modules_at(policy, i)) for i in range(4)] == [
        ["core_attn", "mlp"], ["core_attn", "mlp"], ["core_attn"], ["core_attn", "full"]]
    assert load_config(None, ['model.recompute=["mlp@0-1", "layernorm"]']).model.recompute == ("mlp@0-1", "layernorm")


@pytest.mark.parametrize("value, words", [
    ('["mlp", "attn"]', "[model].recompute item 'attn' is not module[@first[-last]]"),
    ('["mlp@3-1"]', "[model].recompute item 'mlp@3-1' is not module[@first[-last]]"),
    ('["full@0-99"]', "names layers past the model's 0..7"),
    ('["mla_up_proj"]', "needs a latent attention (attention='gqa' has no up-projections)"),
    ('["moe"]', "needs MoE layers"),
    ("[1]", "[model].recompute must be a string or a list of strings"),
])
def test_a_bad_recompute_policy_is_one_line(value, words):
    with pytest.raises(UsageError) as e:
        load_config(None, [f"model.recompute={value}"])
    assert words in str(e.value)


@pytest.mark.parametrize("value, words", [
    ('["core_attn"]', "[model].offload item 'core_attn' is not module[@first[-last]] with a module of attn, mlp"),
    ('["layers:0"]', "or layers:N (N >= 1)"),
    ('["mlp@8"]', "names layers past the model's 0..7"),
    ('"mlp"', "[model].offload must be a list of strings"),
])
def test_a_bad_offload_is_one_line(value, words):
    with pytest.raises(UsageError) as e:
        load_config(None, [f"model.offload={value}"])
    assert words in str(e.value)
