"""par's ZeRO-3 with ``[train].buddy_shards = 1`` under a pipeline and under eod_mask_loss: after a loss at dp3, the two
survivors split the step's three micro-batches 2 + 1, and the replica with one runs a zero-weight copy of it
(training/replica_padding.py) so that every stage's per-micro-batch param gathers over the dp stay matched: the
pipeline schedule of each survivor is built for the padded count on every stage, and eod_mask_loss's global count of
kept predictions leaves the copy out. The curve is the uninterrupted ZeRO-3 run's, and a replacement that rejoins ends
bitwise equal to the live replicas."""

import pytest

from test_replica_faults import EOD, _check_fault_run, reference  # noqa: F401  (reference: the module fixture)
from test_replica_faults_zero3_buddies import ZERO3

PP2 = ("--set", "parallel.pp=2", "--set", "train.micro_batch=2")  # dp3: three micro-batches a step, 2 + 1 after a loss
BUDDIES = ("--set", "train.buddy_shards=1")
# a rank hung in a collective (a stage that ran another count of micro-batches than its dp peers) fails at the
# collective's timeout, then waits join_timeout_s for a next generation that never comes: the run ends with one line
# naming the rank well inside the test's timeout
HANG = ("--set", "train.collective_timeout_s=45", "--set", "train.join_timeout_s=30")

ZERO3_BUDDIES = ["train.fault_tolerance=replica", "parallel.zero=optim_grads_params", "train.buddy_shards=1"]


@pytest.mark.parametrize("sets,world,refused", [
    (["parallel.pp=2"], 4, None), (["data.eod_mask_loss=true"], 2, None),
    (["parallel.pp=2", "data.eod_mask_loss=true"], 4, None),
    (["model.num_experts=4", "model.top_k=2", "model.moe_ffn_hidden=32"], 2, "got [model].num_experts=4"),
    (["parallel.cp=2", "parallel.dynamic_cp=true", "parallel.max_seq_per_rank=32", "data.document_mask=true"], 4,
     "got [parallel].dynamic_cp=true")])
def test_zero3_buddies_pad_under_a_pipeline_and_eod_mask_loss_and_still_refuse_experts_and_dynamic_cp(sets, world, refused):
    """The refusal once named "[parallel].pp" and "[data].eod_mask_loss" too ("built for dense models at pp=1 without
    eod_mask_loss or dynamic_cp"); those layouts validate now, while MoE and dynamic CP are still refused."""
    from pretrain.config import load_config
    from pretrain.errors import UsageError

    if refused is None:
        assert load_config(None, ZERO3_BUDDIES + sets).validate_world(world).dp == 2
        return
    with pytest.raises(UsageError) as e:
        load_config(None, ZERO3_BUDDIES + sets).validate_world(world)
    assert refused in str(e.value) and "pp=1" not in str(e.value) and "eod_mask_loss" not in str(e.value), e.value


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_dp3_x_pp2_zero3_buddies_eod_mask_loss_a_padded_survivor_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference, fault_ranks):  # noqa: F811
    """Rank 5 (replica 2's last stage) killed in the backward of step 2: replica 0 trains micro-batch 0 and a padding
    copy on both stages, replica 1 micro-batches 1 and 2, until the replacement rejoins before step 4."""
    _check_fault_run(tmp_path, 3, 5, 2, "backward", reference, layout=(*ZERO3, *PP2, *EOD, *BUDDIES, *HANG), admit_before=4,
                     reference_layout=(*ZERO3, *PP2, *EOD))
