"""The MoE step-by-step comparison (moe_stepwise) itself: what it lets through and what it refuses."""

import pytest

from layout_runs import STEPS
from moe_stepwise import ROUTING_NOISE, assert_moe_steps_same, recorded_routing

LOADS = {"model.layers.1.mlp.router.weight": [10, 20, 30, 40]}
ONE_PAIR = {"model.layers.1.mlp.router.weight": [11, 19, 30, 40]}
FIVE_PAIRS = {"model.layers.1.mlp.router.weight": [15, 15, 30, 40]}


def reference(margin=ROUTING_NOISE / 2):
    return [(5.0 - 0.1 * s, 2.0, LOADS, margin) for s in range(STEPS)]


def layout(changes=None):
    """One rank's steps equal to the reference, but for ``changes``: {step: (loss, norm, loads)}."""
    steps = [(5.0 - 0.1 * s, 2.0, LOADS) for s in range(STEPS)]
    for step, change in (changes or {}).items():
        steps[step] = change
    return [steps]


def test_equal_steps_pass_and_a_small_error_fails():
    assert assert_moe_steps_same(layout(), reference(), 1e-6, "same") == []
    with pytest.raises(AssertionError, match="grad norm"):
        assert_moe_steps_same(layout({3: (4.7, 2.0 * (1 + 3e-6), LOADS)}), reference(), 1e-6, "norm off")


def test_a_near_tie_flip_is_reported_not_compared():
    flipped = layout({4: (4.6 * (1 + 1e-6), 2.1, ONE_PAIR)})  # its grad norm moved 5 %: not compared
    assert assert_moe_steps_same(flipped, reference(), 1e-6, "flip") == [4]


@pytest.mark.parametrize("why", ["wide margin", "five pairs", "loss moved", "too many flips"])
def test_a_routing_difference_no_tie_explains_fails(why):
    ref, run = reference(), layout({4: (4.6, 2.1, ONE_PAIR)})
    if why == "wide margin":
        ref = reference(margin=10 * ROUTING_NOISE)
    elif why == "five pairs":
        run = layout({4: (4.6, 2.1, FIVE_PAIRS)})
    elif why == "loss moved":
        run = layout({4: (4.6 * 1.001, 2.1, ONE_PAIR)})
    else:
        run = layout({s: (5.0 - 0.1 * s, 2.1, ONE_PAIR) for s in (1, 5, 9, 13)})
    with pytest.raises(AssertionError):
        assert_moe_steps_same(run, ref, 1e-6, why)


def test_recorded_routing_leaves_par_moe_as_found():
    """The harness reuses its worker processes: a hook left behind would perturb every later test."""
    import par_moe.layer
    import par_moe.router

    before = (par_moe.layer.MoELayer.apply_bias, par_moe.router.F, par_moe.router.Router.forward)
    with pytest.raises(RuntimeError), recorded_routing([], perturb=2.0 ** -23):
        assert par_moe.router.F is not before[1]
        raise RuntimeError
    assert (par_moe.layer.MoELayer.apply_bias, par_moe.router.F, par_moe.router.Router.forward) == before
