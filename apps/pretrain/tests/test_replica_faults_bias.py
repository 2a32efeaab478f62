"""Aux-loss-free balancing (``[model].bias_update_rate > 0``) under ``[train].fault_tolerance = "replica"``: dp2 x
ep2 (an expert-parallel group is the failure domain), every step's expert bias moved by its routed pairs summed over
every rank. One rank SIGKILLed in step 2's optimizer step (the survivors complete the update: a bias summed after it
would be a collective with the lost replica), or in step 3's gradient reduction, its replacement rejoining before
step 4. The curve is the uninterrupted run's (fp32, 1e-6), every sample once, no process left, the replicas' owned
pieces bitwise equal, the expert bias among them (test_replica_faults.py's checks); every bias update any rank
applied counted each of its step's routed pairs once: the discarded attempt's not, the lost replica's micro-batches
(trained by the survivors in the redo) too. Planted bugs, each caught: a joiner without the bias it was sent, a
regrouped trainer that keeps the discarded step's counts."""

import functools
import json

import pytest

from test_replica_faults import _check_fault_run, _moe, reference  # noqa: F401 -- the fixture

LAYOUT = (*_moe("none"), "--set", "model.bias_update_rate=0.1")
PAIRS = 2 * 4 * 16 * 2  # a step's routed pairs per layer: global batch 2 x dp, 16 tokens each, top-2


def _check(tmp, reference, plant: str = "", rank: int = 2, step: int = 3, phase: str = "reduction",
           admit_before: int = 4) -> None:
    import bias_kills

    _check_fault_run(tmp, 4, rank, step, phase, reference, layout=LAYOUT, admit_before=admit_before, shard=2,
                     entry=functools.partial(bias_kills.balanced, plant))
    applied = {p.name: json.loads(p.read_text()) for p in (tmp / "pids").glob("bias_*.json")}
    survivors = [r for r in range(4) if r // 2 != rank // 2]
    assert {f"bias_{r}_{s}.json" for r in survivors for s in range(1, 5)} <= applied.keys(), sorted(applied)
    for name, loads in applied.items():
        assert loads and [sum(load) for load in loads] == [PAIRS] * len(loads), (name, loads)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,step,phase,admit_before", [(1, 2, "optimizer", 0), (2, 3, "reduction", 4)],
                         ids=["in-the-optimizer-step", "in-the-reduction-rejoined"])
def test_dp2_x_ep2_bias_balancing_a_replica_killed_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference, fault_ranks, rank, step, phase, admit_before):
    _check(tmp_path, reference, rank=rank, step=step, phase=phase, admit_before=admit_before)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plant", ["joiner_without_the_bias", "discarded_counts_kept"])
def test_a_planted_bias_balancing_bug_is_caught(tmp_path, reference, fault_ranks, plant):
    with pytest.raises(AssertionError):
        _check(tmp_path, reference, plant)
