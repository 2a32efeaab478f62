"""The memory model reproduces the explainer's 7B figures and HSDP's 1/h (pure functions)."""

import pytest
import torch

from par_zero import bytes_per_param, model_state, model_state_for_params

P, G, O = 14, 14, 56  # GB: 7B params, bf16 params and grads, fp32 Adam moments


def test_explainer_7b_numbers_at_dp8():
    assert model_state(P, G, O, "no_shard", 8).total == 84
    totals = [model_state(P, G, O, s, 8).total for s in ("optim", "optim_grads", "optim_grads_params")]
    assert totals == [35, 22.75, 10.5]
    assert [round(100 * t / 84, 1) for t in totals] == [41.7, 27.1, 12.5]


@pytest.mark.parametrize("h", [2, 4, 8])
def test_hsdp_holds_one_over_h_of_ddp(h):
    hsdp = model_state(P, G, O, "optim_grads_params", h, outer=64 // h)
    assert hsdp.total == pytest.approx(84 / h)
    assert model_state(P, G, O, "torch_fsdp2", h, outer=64 // h).total == pytest.approx(84 / h)


def test_outer_optim_also_splits_grads_and_optimizer_over_replicas():
    m = model_state(P, G, O, "optim_grads_params", 8, outer=8, outer_strategy="optim")
    assert (m.params, m.grads, m.optim) == (P / 8, G / 64, O / 64)


def test_bytes_per_param_counts_master_only_when_params_are_not_fp32():
    assert bytes_per_param(torch.float32) == (4, 4, 8)
    assert bytes_per_param(torch.bfloat16) == (2, 2, 12)
    assert bytes_per_param(torch.bfloat16, torch.float32) == (2, 4, 12)
    assert model_state_for_params(1000, "optim", 4).total == 4000 + 4000 + 2000


def test_invalid_layouts_are_rejected_with_the_valid_choices():
    with pytest.raises(ValueError, match="optim_grads_params"):
        model_state(P, G, O, "optim", 4, outer=2, outer_strategy="optim")
    with pytest.raises(ValueError, match="strategy='zero4'"):
        model_state(P, G, O, "zero4", 4)
    with pytest.raises(ValueError, match="sharded inner strategy"):
        model_state(P, G, O, "no_shard", 4, outer=2)
