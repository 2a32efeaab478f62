"""What a regroup's garbage collection walks: a survivor leaving its generation collects (fault_replica._leave_groups)
so that the old groups, held in reference cycles, close at once, and it stands still meanwhile. Under fault tolerance a
rank freezes what it imported before the run makes anything, so that collection walks the run's objects only, not
torch's; counted here on run_rank in this process, stopped where it would join its process group."""

import gc

import pytest

from pretrain.training.run import run_rank


class _Joined(Exception):
    """run_rank stopped at its process group's creation: nothing of the run exists yet."""


@pytest.mark.parametrize("fault_tolerance", ["replica", "off"])
def test_a_fault_tolerant_rank_leaves_its_imports_out_of_every_later_collection(monkeypatch, fault_tolerance):
    walked = {}

    def join(*args, **kwargs):
        walked["objects"] = len(gc.get_objects())  # what a full collection walks now: every object not frozen
        raise _Joined

    monkeypatch.setattr("pretrain.training.run.init_distributed", join)
    gc.unfreeze()  # the test session froze its imports: undone, as in a rank process fresh from the forkserver
    try:
        imported = len(gc.get_objects())
        with pytest.raises(_Joined):
            run_rank(None, [f"train.fault_tolerance={fault_tolerance}"])
    finally:
        gc.freeze()  # the session's state again (its plugin's freeze)
    if fault_tolerance == "replica":
        assert walked["objects"] < imported // 100, (walked, imported)
    else:  # a run without fault tolerance collects as before: nothing frozen
        assert walked["objects"] > imported // 2, (walked, imported)
