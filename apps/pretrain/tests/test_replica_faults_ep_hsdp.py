"""``[train].fault_tolerance = "replica"`` under HSDP with expert parallelism: a real SIGKILL of one rank of
an HSDP 2 x 2 MoE run with ep2."""

import pytest

from test_replica_faults import HSDP, _check_fault_run, _moe, reference  # noqa: F401 -- the module fixture

EP_HSDP = (*HSDP, *_moe("replicate"), "--set", "model.bias_update_rate=0.01")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase,admit_before", [(3, "backward", 0), (1, "optimizer", 4)])
def test_hsdp_2x2_ep2_a_replica_killed_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, rank,
                                                                            phase, admit_before):
    _check_fault_run(tmp_path, 4, rank, 2, phase, reference, layout=EP_HSDP, admit_before=admit_before, shard=2)
