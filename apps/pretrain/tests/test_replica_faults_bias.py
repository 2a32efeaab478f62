"""Aux-loss-free balancing (``[model].bias_update_rate > 0``) under ``[train].fault_tolerance = "replica"``: dp2 x
ep2 (an expert-parallel group is the failure domain), every step's expert bias moved by its routed pairs summed over
every rank. One rank SIGKILLed in step 2's optimizer step (the survivors complete the update: a bias summed after it
would be a collective with the lost replica), or in step 3's gradient reduction, its replacement rejoining before
step 4. The curve is the uninterrupted run's (fp32, 1e-6), every sample once, no process left, the replicas' owned
pieces bitwise equal, the expert bias among them (test_replica_faults.py's checks); every bias update any rank
applied counted each of its step's routed pairs once: the discarded attempt's not, the lost replica's micro-batches
(trained by the survivors in the redo) too; a skipped update's counts go into the next one, over a regroup and to a
joiner (fails on the in-place sum before the optimizer step: a regroup's fresh trainer drops them). Planted bugs, each caught: a joiner without the bias it was sent, a
regrouped trainer that keeps the discarded step's counts."""

import functools
import json

import pytest

from test_replica_faults import _check_fault_run, _curve, _moe, _run, reference  # noqa: F401 -- the fixture

LAYOUT = (*_moe("none"), "--set", "model.bias_update_rate=0.1")
PAIRS = 2 * 4 * 16 * 2  # a step's routed pairs per layer: global batch 2 x dp, 16 tokens each, top-2


def _check(tmp, reference, plant: str = "", rank: int = 2, step: int = 3, phase: str = "reduction",
           admit_before: int = 4, layout: tuple = LAYOUT, skipped: tuple = ()) -> None:
    """``skipped``: the steps whose updates are skipped in both runs (their counts go into the next update)."""
    import bias_kills

    _check_fault_run(tmp, 4, rank, step, phase, reference, layout=layout, admit_before=admit_before, shard=2,
                     entry=functools.partial(bias_kills.balanced, plant, skip=skipped), updates=4 - len(skipped))
    applied = {p.name: json.loads(p.read_text()) for p in (tmp / "pids").glob("bias_*.json")}
    survivors = [r for r in range(4) if r // 2 != rank // 2]
    assert {f"bias_{r}_{s}.json" for r in survivors for s in range(1, 5)} <= applied.keys(), sorted(applied)
    for name, loads in applied.items():
        done = int(name.split("_")[2].split(".")[0])  # the step's pairs, and the skipped steps' right before it
        steps = next(n for n in range(1, done + 1) if done - n not in skipped)
        want = [] if done in skipped else [steps * PAIRS] * len(loads)
        assert (loads or done in skipped) and [sum(load) for load in loads] == want, (name, loads)


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


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("skipped,step", [((2,), 2), ((2, 3), 3)], ids=["skipped-step-redone", "kept-over-a-regroup"])
def test_dp2_x_ep2_skipped_updates_counts_reach_the_next_update_and_the_joiner(tmp_path, reference, fault_ranks,
                                                                              skipped, step):
    """The ``skipped`` steps skip their updates in both runs (nan_policy=skip, their gradient norm non-finite where
    the skip is decided), their counts kept for the next update; a rank killed in ``step``'s reduction (the skipped
    step itself, redone; or the next skipped one: the survivors' regrouped trainers keep step 2's), its replacement
    joining right after the last skipped step and receiving the kept counts."""
    import bias_kills

    layout = (*LAYOUT, "--set", "train.nan_policy=skip")

    def skipping_reference(dp, tp, layout):  # the uninterrupted run, the same steps skipped
        with pytest.MonkeyPatch.context() as m:
            m.setattr("pretrain.training.run.run_rank", functools.partial(bias_kills.skipping, skipped))
            res = _run(tmp_path / "ref", dp, tp=tp, layout=layout)
        assert res.exit_code == 0, res.output
        return _curve(tmp_path / "ref" / "log")

    _check(tmp_path, skipping_reference, rank=1, step=step, admit_before=max(skipped) + 1, layout=layout,
           skipped=skipped)
