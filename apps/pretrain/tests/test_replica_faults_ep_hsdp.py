"""``[train].fault_tolerance = "replica"`` under HSDP with expert parallelism: HSDP 2 x 2 of a MoE model with
ep2 (each expert-parallel group inside one HSDP replica, the failure domain) and aux-loss-free balancing.

Each HSDP replica holds a whole copy of the experts (sharded inside it, replicated over the replicas, as the
dense params), so a lost replica's experts live on in the other, and a joiner receives them from the rank at
its own coordinate. The balancing's bias update sums the step's routed tokens before the optimizer step: a
replica killed in that step leaves the survivors' state as it was, and the redone step is the uninterrupted
run's. A joiner sent the experts of the other ep coordinate (a planted bug) is caught.
"""

import re

import pytest

import replica_kills
from pretrain.config import load_config
from test_replica_faults import HSDP, _check_fault_run, _moe, reference  # noqa: F401 -- the module fixture

EP_HSDP = (*HSDP, *_moe("replicate"), "--set", "model.bias_update_rate=0.01")


def test_ep_with_hsdp_is_no_longer_refused_under_fault_tolerance():
    """The layout once refused ("[parallel].ep with hsdp_replicas") validates: its replicas' experts have a live copy."""
    sets = [a for a in EP_HSDP if a != "--set"] + ["train.fault_tolerance=replica", "model.hidden=32", "model.ffn_hidden=64"]
    layout = load_config(None, sets).validate_world(4)
    assert (layout.dp, layout.ep, layout.edp) == (4, 2, 2)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase,admit_before", [(3, "backward", 0), (1, "optimizer", 4)])
def test_hsdp_2x2_ep2_a_replica_killed_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, rank,
                                                                            phase, admit_before):
    """``admit_before``: the replacement rejoins before step 4, every owned piece (experts included) bitwise the
    live replica's at its coordinate, and the bytes it received the sum of them (and `plan`'s figure)."""
    _check_fault_run(tmp_path, 4, rank, 2, phase, reference, layout=EP_HSDP, admit_before=admit_before, shard=2)


@pytest.mark.extended
@pytest.mark.timeout(120)
def test_a_joiner_sent_the_experts_of_another_ep_coordinate_is_caught(tmp_path, reference, fault_ranks, monkeypatch):
    import expert_source_plant

    monkeypatch.setattr(replica_kills, "sigkill_at", expert_source_plant.wrong_expert_source)
    with pytest.raises(AssertionError) as caught:  # the run stops on the joiner's one line, before its pieces arrive
        _check_fault_run(tmp_path, 4, 1, 2, "optimizer", reference, layout=EP_HSDP, admit_before=4, shard=2)
    found = re.search(r"RuntimeError: state from rank \d is of coordinate \{[^}]*'ep': (\d)[^}]*\}, "
                      r"not this joiner's \{[^}]*'ep': (\d)", str(caught.value))
    assert found and found[1] != found[2], str(caught.value)
