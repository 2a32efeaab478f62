"""``[model].expert_balance = "replicate+replace"`` under ``[train].fault_tolerance = "replica"``: dp2 x ep2 (an
expert-parallel group is the failure domain), the experts re-placed after steps 2 and 4, one rank SIGKILLed in
step 3's gradient reduction (the placement changed at step 2; the survivors had counted step 3's routed pairs
when it was discarded), its replacement rejoining before step 4; and one killed in the optimizer step of the
re-placement step 2 (the survivors complete it and re-place, then notice the loss in step 3). The curve is the
uninterrupted run's (fp32, 1e-6), every sample once, no process left, the replicas' owned pieces bitwise equal
(test_replica_faults.py's checks); every rank, the joiner too, holds the uninterrupted run's placement and load
after each step it completed (its checkpoints' ``expert_placement``), so a step redone is counted once. Planted
bugs, each caught: a joiner routing by its own placement instead of the one it received, a regrouped trainer that
keeps the discarded step's counts."""

import functools
import json
from pathlib import Path

import pytest

from test_replica_faults import _check_fault_run, _moe, _records, reference  # noqa: F401 -- the fixture

LAYOUT = (*_moe("replicate+replace"), "--set", "model.replace_every=2", "--set", "checkpoint.every=3")


def _saved(root: Path, step: int) -> dict:
    """The ``expert_placement`` a checkpoint of ``step`` under ``root`` saved: per layer (by name), its map and load."""
    state = json.loads(next(root.glob(f"**/step_{step}/trainer_state.json")).read_text())
    layers = state["expert_placement"]["layers"]
    return {key: [layers[name][key] for name in sorted(layers)] for key in ("expert_at", "load")}


def _check(tmp: Path, reference, plant: str = "", rank: int = 1, step: int = 3, phase: str = "reduction",
           admit_before: int = 4) -> None:
    import replace_kills

    _check_fault_run(tmp, 4, rank, step, phase, reference, layout=LAYOUT, admit_before=admit_before, shard=2,
                     entry=functools.partial(replace_kills.placed, plant))
    ref = next(p for p in reference.root.iterdir() if "replace_every" in p.name)
    moved = [(e["step"], e["experts_moved"]) for e in _records(ref / "log") if e.get("event") == "expert_placement"]
    assert [s for s, _ in moved] == [2, 4] and moved[0][1] > 0, moved  # the placement changes at step 2
    pids, survivors = tmp / "pids", [r for r in range(4) if r // 2 != rank // 2]
    for done in (3, 4):  # after the redo; at 4 the joiners' too
        want = _saved(ref, done)
        assert _saved(tmp, done) == want, done
        for r in range(4) if done == 4 and admit_before else survivors:
            got = json.loads((pids / f"placement_{r}_{done}.json").read_text())
            assert got == {"expert_at": [list(e) for e in want["expert_at"]], "load": want["load"]}, (done, r)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,step,phase,admit_before", [(1, 3, "reduction", 4), (3, 2, "optimizer", 0)],
                         ids=["after-a-replacement-rejoined", "in-a-replacement-step"])
def test_dp2_x_ep2_replicate_replace_a_replica_killed_keeps_the_uninterrupted_placement(
        tmp_path, reference, fault_ranks, rank, step, phase, admit_before):
    _check(tmp_path, reference, rank=rank, step=step, phase=phase, admit_before=admit_before)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plant", ["joiner_keeps_its_placement", "discarded_counts_kept"])
def test_a_planted_placement_bug_is_caught(tmp_path, reference, fault_ranks, plant):
    with pytest.raises(AssertionError):
        _check(tmp_path, reference, plant)
