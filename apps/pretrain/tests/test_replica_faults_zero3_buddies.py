"""par's ZeRO-3 (``zero = "optim_grads_params"``) over the whole dp with ``[train].buddy_shards = 1``: each rank also
holds and steps the next rank's shard (its master, which in fp32 is that rank's param shard, and its moments) from
the all-reduced gradients. A replica killed in the gradient reduction or in the optimizer step leaves its shard on
its buddy; the survivors re-shard ZeRO-3 over themselves from the owners' and buddies' copies and go on with the
uninterrupted ZeRO-3 run's curve, and a replacement that rejoins receives its shard and its buddy's bitwise; a resume
reads each buddy range from its owner's saved pieces."""


import pytest

from test_replica_faults import _check_buddy_resume, _check_fault_run, _curve, _run, reference  # noqa: F401  (reference: the module fixture)

ZERO3 = ("--set", "parallel.zero=optim_grads_params")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,rank,step,phase,admit_before", [(2, 1, 2, "reduction", 4), (3, 2, 3, "optimizer", 0)])
def test_zero3_with_buddy_shards_a_replica_killed_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference, fault_ranks, dp, rank, step, phase, admit_before):  # noqa: F811
    _check_fault_run(tmp_path, dp, rank, step, phase, reference, layout=(*ZERO3, "--set", "train.buddy_shards=1"),
                     admit_before=admit_before, reference_layout=ZERO3)


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_zero3_resume_with_buddy_shards_reads_each_buddy_range_from_its_owners_pieces(tmp_path, fault_ranks):
    """A ZeRO-3 checkpoint holds each shard once (its owner's); a resumed rank's buddy master and moments are read
    from it, so the buddy is its owner's state bitwise again."""
    _check_buddy_resume(tmp_path, (*ZERO3, "--set", "train.buddy_shards=1"))
