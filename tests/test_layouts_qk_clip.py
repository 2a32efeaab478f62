"""[train].muon_qk_clip under layouts equals the single rank with it (the suite's rule: 1e-6).

A head's max logit is over the whole batch and sequence: dp ranks hold other sequences, cp ranks
other tokens (their keys too: an all-gather of k), so both share an all-reduce MAX; TP ranks hold
other heads, their own W_q/W_k rows, pipeline stages their own layers. ZeRO-3 scales the rows of
its master ranges. tau = 0.05 sits inside the tiny model's head maxes (0.01..0.14 over 20 steps), so
most heads clip each step; the clip changes the run (checked against the single rank without it),
so a max missing a rank's share, or a row on the wrong head, shows in the losses and grad norms.
"""

import pytest

from layout_runs import assert_same, max_errors, single_rank, train_steps
from layout_runs import deferred_noise as noise

TOLERANCE = 1e-6
MUON = ("train.optimizer=muon", "train.muon_ns_dtype=fp32")
CLIP = MUON + ("train.muon_qk_clip=0.05",)
MHA = ("model.kv_heads=8",)  # a key head per query head: W_k's rows scale too
PACKED_KEYS = ("data.document_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true")
LAYOUTS = {  # name: (world, the single rank's overrides, the layout's)
    "dp2-zero3": (2, (), ["parallel.zero=optim_grads_params"]),
    "tp2-sp": (2, (), ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2-mha": (2, MHA, ["parallel.tp=2"]),
    "cp2": (2, MHA, ["parallel.cp=2"]),
    "cp2-a2a-packed": (2, "packed", ["parallel.cp=2", "parallel.cp_comm_type=a2a"]),
    "pp2": (2, (), ["parallel.pp=2", "parallel.microbatches=4"]),
}


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory):
    from test_packed_documents import packed_dataset

    return packed_dataset(tmp_path_factory.mktemp("packed") / "docs")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qk_clip_layout_matches_single_rank(dist_run, packed_data, name):
    world, model, layout = LAYOUTS[name]
    if model == "packed":  # short documents: the max is over each document's own pairs
        model = (f"data.path={packed_data}",) + PACKED_KEYS
    reference = single_rank(dist_run, None, CLIP + model)
    loss, norm = max_errors(reference, single_rank(dist_run, None, MUON + model))
    print(f"{name}: the clip moves the single rank by loss {loss:.1e} grad norm {norm:.1e}")
    assert loss > 10 * TOLERANCE and norm > 100 * TOLERANCE, (loss, norm)  # the clip bites
    results = dist_run(world, train_steps, None, list(CLIP + model) + layout, timeout=900)
    assert_same(results, reference, TOLERANCE, name, noise(dist_run, None, CLIP + model))
