"""The layout tests' comparison itself: 1e-6 at every step, wider only where the single rank's own
rounding noise says so, and never wider than NOISE_MARGIN times that noise."""

import pytest

from layout_runs import NOISE_MARGIN, assert_close_steps

REFERENCE = ([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])  # losses, grad norms


def _noise(norm_noise):
    return lambda: ([0.0, 0.0, 0.0], norm_noise)


def test_within_the_tolerance_needs_no_noise():
    assert_close_steps(([2.0, 2.0 * (1 + 9e-7), 2.0], [1.0, 1.0, 1 - 9e-7]), REFERENCE, 1e-6, "x", steps=3)


def test_past_the_tolerance_fails_without_a_noise_measurement():
    with pytest.raises(AssertionError, match="step 1: grad norm"):
        assert_close_steps(([2.0] * 3, [1.0, 1 + 2e-6, 1.0]), REFERENCE, 1e-6, "x", steps=3)


def test_past_the_tolerance_passes_only_within_the_margin_over_that_steps_noise():
    result = ([2.0] * 3, [1.0, 1 + 2e-6, 1.0])
    assert_close_steps(result, REFERENCE, 1e-6, "x", _noise([0.0, 2.5e-6 / NOISE_MARGIN, 0.0]), steps=3)
    with pytest.raises(AssertionError, match="rounding noise"):
        assert_close_steps(result, REFERENCE, 1e-6, "x", _noise([0.0, 1.5e-6 / NOISE_MARGIN, 0.0]), steps=3)
    with pytest.raises(AssertionError, match="rounding noise"):  # another step's noise does not count
        assert_close_steps(result, REFERENCE, 1e-6, "x", _noise([1.0, 0.0, 1.0]), steps=3)


def test_noise_is_measured_only_when_a_step_needs_it():
    def never():
        raise AssertionError("measured")

    assert_close_steps(REFERENCE, REFERENCE, 1e-6, "x", never, steps=3)
