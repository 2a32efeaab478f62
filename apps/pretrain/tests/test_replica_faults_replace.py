"""``[model].expert_balance = "replicate+replace"`` under ``[train].fault_tolerance = "replica"``: dp2 x ep2 (an
expert-parallel group is the failure domain), the experts re-placed after steps 2 and 4, one rank SIGKILLed in
step 3's gradient reduction (the placement changed at step 2; the survivors had counted step 3's routed pairs
when it was discarded), its replacement rejoining before step 4. The curve is the uninterrupted run's (fp32,
1e-6), every sample once, no process left, the replicas' owned pieces bitwise equal (test_replica_faults.py's
checks); every rank, the joiner too, holds the uninterrupted run's placement and load after each step it
completed (its checkpoints' ``expert_placement``), so a step redone is counted once. Planted bugs, each caught:
a joiner that does not receive the placement, a regrouped trainer that keeps the discarded step's counts."""

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
    return {"expert_at": [layers[n]["expert_at"] for n in sorted(layers)], "load": [layers[n]["load"] for n in sorted(layers)]}


def _check(tmp: Path, reference, plant: str) -> None:
    import replace_kills

    _check_fault_run(tmp, 4, 1, 3, "reduction", reference, layout=LAYOUT, admit_before=4, shard=2,
                     entry=functools.partial(replace_kills.placed, plant))
    ref = next(p for p in reference.root.iterdir() if "replace_every" in p.name)
    moved = [(e["step"], e["experts_moved"]) for e in _records(ref / "log") if e.get("event") == "expert_placement"]
    assert [s for s, _ in moved] == [2, 4] and moved[0][1] > 0, moved  # the kill is under a changed placement
    pids = tmp / "pids"
    for step in (3, 4):  # the survivors' (ranks 2 and 3) after the redo; at 4 the joiners' (0 and 1) too
        want = _saved(ref, step)
        assert _saved(tmp, step) == want, step
        for rank in (0, 1, 2, 3) if step == 4 else (2, 3):
            got = json.loads((pids / f"placement_{rank}_{step}.json").read_text())
            assert got == {"expert_at": [list(e) for e in want["expert_at"]], "load": want["load"]}, (step, rank)


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_dp2_x_ep2_replicate_replace_killed_after_a_replacement_rejoins_with_its_placement(tmp_path, reference,
                                                                                       fault_ranks):
    _check(tmp_path, reference, "")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plant", ["discarded_counts_kept"])
def test_a_planted_placement_bug_is_caught(tmp_path, reference, fault_ranks, plant):
    with pytest.raises(AssertionError):
        _check(tmp_path, reference, plant)
