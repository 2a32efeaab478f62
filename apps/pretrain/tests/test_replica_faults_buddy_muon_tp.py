"""Muon under par's ZeRO-1 with ``[train].buddy_shards = 1`` at tp 2: the survivors' generation (dp 1) sums the
squared gradient norm over other ranges than the uninterrupted run (dp 2). The sum is in float64 (par_zero's
clipping), so the norm, the clip coefficient and with them every update keep the uninterrupted run's bits; in
float32 a last-bit change of the norm went through Muon's Newton-Schulz into the weights, and the curve after the
rejoin left the uninterrupted one."""

import pytest

from test_replica_faults import _check_fault_run, _curve, reference  # noqa: F401  (reference: the module fixture)

MUON_ZERO1 = ("--set", "parallel.zero=optim", "--set", "train.optimizer=muon")


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_dp2_tp2_muon_zero1_with_buddy_shards_killed_in_the_optimizer_step_keeps_the_uninterrupted_curve_bitwise(
        tmp_path, reference, fault_ranks):  # noqa: F811
    _check_fault_run(tmp_path, 2, 3, 2, "optimizer", reference, tp=2,
                     layout=(*MUON_ZERO1, "--set", "train.buddy_shards=1"), admit_before=4, reference_layout=MUON_ZERO1)
    # every step's loss and norm the uninterrupted run's bits: the dp-1 generation's norm included
    assert _curve(tmp_path / "log") == reference(2, 2, MUON_ZERO1)
