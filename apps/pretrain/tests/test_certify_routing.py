"""certify's MoE routing rule on synthetic data: a near-tie flip is reported and not compared at the
band; any other routing difference is NOT certified at its MoE layer (pretrain.certify.routing)."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.certify.localise import ShardContext
from pretrain.certify.routing import (FLIPPED_LOSS_TOLERANCE, MAX_MOVED_PAIRS, ROUTING_NOISE, compare_routing,
                                      routed_pairs, smallest_margin)
from pretrain.certify.verdict import judge_step, verdict_line

ROUTER = "layers.1.mlp.router"
ORDER = ["embed_tokens", "layers.0", "layers.1.post_attention_layernorm", ROUTER, "layers.1.mlp", "layers.1", "logits"]
REF = {"layers.1.mlp.router": [10, 6, 8, 8], "layers.2.mlp.router": [8, 8, 8, 8]}
CTX = ShardContext(tp=2, tp_rank=0, cp=1, cp_rank=0, dp=1, dp_rank=0, pp=1, ep=2, micro_batch=1, per_rank=2, vocab=256,
                   zero_sharded=False)
OWNERS = {"layers.1.mlp": {"chunk": 0, "pp_rank": 0, "expert": True, "tp": True}}


def moved(layer1, layer2=None):
    return {"layers.1.mlp.router": layer1, "layers.2.mlp.router": layer2 or REF["layers.2.mlp.router"]}


def step_record(routing, out_err=None, loss=2.0, grad_err=None, grad_norm=1.0):
    """judge_step on a synthetic step: the reference's loss 2.0 and grad norm 1.0, fp64 noise 1e-7."""
    ref = {"loss": 2.0, "grad_norm": 1.0, "loss64": 2.0 * (1 + 1e-7), "norm64": 1.0 + 1e-7,
           "noise_out": {n: 1e-7 for n in ORDER}, "noise_grad": {"layers.1.mlp.router.weight": 1e-7}}
    out_err = {n: 1e-7 for n in ORDER} | (out_err or {})
    grad_err = grad_err or {"layers.1.mlp.router.weight": 1e-7}
    return judge_step(0, {"loss": loss, "grad_norm": grad_norm}, ref, out_err, grad_err, {}, OWNERS, ORDER,
                      ["layers.1.mlp.router.weight"], CTX, 4.0, routing)


def test_counts_and_margins_of_a_router_call():
    indices = torch.tensor([[0, 2], [2, 3], [0, 2]])
    assert routed_pairs(indices, 5) == [2, 0, 3, 1, 0]
    scores = torch.tensor([[0.5, 0.3, 0.2 + 3e-7, 0.2 - 3e-7], [0.4, 0.3, 0.2, 0.1]])
    assert smallest_margin(scores, torch.zeros(4), 2) == pytest.approx(0.1, abs=1e-6)
    assert smallest_margin(scores, torch.zeros(4), 3) == pytest.approx(6e-7, abs=1e-7)
    assert smallest_margin(scores, torch.tensor([0.0, 0.1, 0.0, 0.0]), 1) == pytest.approx(0.0, abs=1e-6)  # bias counts
    assert math.isinf(smallest_margin(scores, torch.zeros(4), 4))  # nothing to flip to


def test_same_routing_is_no_finding_and_the_step_is_compared_at_the_band():
    assert compare_routing(dict(REF), REF, {ROUTER: 1e-3}, ORDER, 0.0) is None
    rec = step_record(None, out_err={"layers.1.mlp": 1e-3})
    assert not rec["certified"] and rec["first_divergence"]["module"] == "layers.1.mlp"


def test_a_near_tie_flip_is_reported_not_compared_at_the_band():
    r = compare_routing(moved([9, 7, 8, 8]), REF, {ROUTER: 3e-7}, ORDER, 2e-6)
    assert r["near_tie"] and r["moved_pairs"] == 1 and r["layer"] == "layers.1.mlp", r
    # outputs after the flipped router and the gradients are another computation's: not compared
    rec = step_record(r, out_err={"layers.1.mlp": 0.3, "logits": 0.1}, loss=2.0 * (1 + 2e-6),
                      grad_err={"layers.1.mlp.router.weight": 0.5}, grad_norm=1.3)
    assert rec["certified"] and rec["first_divergence"] is None, rec
    line, code = verdict_line([rec, step_record(None)], "tp=2 ep=2")
    assert code == 0 and line.startswith("certified:") and "step 0: MoE routing flipped at a near-tie at layers.1.mlp" in line, line
    # outputs before the router still are
    rec = step_record(r, out_err={"layers.0": 1e-3})
    assert not rec["certified"] and rec["first_divergence"]["module"] == "layers.0", rec
    # a flip in a later layer caused by the first one's (the same token) counts with it: 2 pairs in all
    r = compare_routing(moved([9, 7, 8, 8], [9, 7, 8, 8]), REF, {ROUTER: 3e-7, "layers.2.mlp.router": 1.0}, ORDER, 0.0)
    assert r["near_tie"] and r["moved_pairs"] == MAX_MOVED_PAIRS and r["router"] == ROUTER, r


@pytest.mark.parametrize("case", ["too_many_pairs", "no_near_tie", "loss_moved", "one_side_only"])
def test_any_other_routing_difference_is_not_certified_at_its_moe_layer(case):
    got, margin, loss_error, why = {
        "too_many_pairs": (moved([7, 9, 8, 8]), 3e-7, 0.0, "3 pairs moved"),
        "no_near_tie": (moved([9, 7, 8, 8]), 10 * ROUTING_NOISE, 0.0, "no near-tie"),
        "loss_moved": (moved([9, 7, 8, 8]), 3e-7, 10 * FLIPPED_LOSS_TOLERANCE, "the loss differs"),
        "one_side_only": ({"layers.2.mlp.router": REF["layers.2.mlp.router"]}, 3e-7, 0.0, "pairs moved; a near-tie"),
    }[case]
    r = compare_routing(got, REF, {ROUTER: margin}, ORDER, loss_error)
    assert not r["near_tie"] and why in r["why"], r
    rec = step_record(r, loss=2.0 * (1 + loss_error))
    first = rec["first_divergence"]
    assert not rec["certified"] and first["kind"] == "routing" and first["module"] == "layers.1.mlp", rec
    assert first["dimension"] == "ep"
    line, code = verdict_line([rec], "tp=2 ep=2")
    assert code == 3 and line.startswith("NOT certified:") and "at MoE layer layers.1.mlp" in line and why in line, line
