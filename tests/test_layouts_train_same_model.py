"""Any layout trains the same model: 20 fp32 steps of a 2-, 4- or 8-layer tiny.toml (and tiny-moe.toml)
under many layouts give the loss and global grad norm of the single-rank run at every step.

The tolerance comes from the measured error (`pytest -s` prints each layout's maximum relative
error over the 20 steps): fp32 layouts differ from one rank by rounding only, at most 2.4e-7 in
the loss and 6.8e-7 in the grad norm (tp2-etp2-ep2; <= 4.2e-7 for the dense ones), so 1e-6. One
step is the exception: the packed-documents run's step 18 moves by 6.5e-6 on the single rank
itself when only its micro-batching changes, so a step past 1e-6 is judged against that rounding
noise (layout_runs.rounding_noise; dense runs only, MoE keeps 1e-6 at every step).

MoE routing is a discrete top-k, and a near-tie flips with the last bit of a score (another CPU's
kernels round differently): the MoE layouts are compared step by step from the same state instead
(tests/moe_stepwise.py: each step of the layout starts from the single rank's checkpoint of that
step, at 1e-6; a routing flip is reported, and passes only as a near-tie of one or two pairs).
"""

import pytest

from layout_runs import COMMON, STEPS, assert_same, single_rank, train_steps
from layout_runs import deferred_noise as noise
from moe_stepwise import PLANTED_STEPS, assert_moe_steps_same, layout_steps, moe_reference  # noqa: F401 (a fixture)

TOLERANCE = 1e-6

DENSE = {
    "dp4": ["parallel.zero=no_shard"],
    "dp4-optim": ["parallel.zero=optim"],
    "dp4-optim_grads": ["parallel.zero=optim_grads"],
    "dp4-optim_grads_params": ["parallel.zero=optim_grads_params"],
    "dp4-torch_fsdp2": ["parallel.zero=torch_fsdp2"],
    "hsdp2x2-optim_grads_params": ["parallel.zero=optim_grads_params", "parallel.hsdp_replicas=2"],
    "tp2-dp2-sp": ["parallel.tp=2"],
    # ZeRO-1 shards over dp=2; SP's gathers/scatters as p2p rings under the matmuls
    "tp2-dp2-sp-optim-overlap": ["parallel.tp=2", "parallel.zero=optim", "parallel.tp_comm_overlap=true"],
    "tp2-cp2": ["parallel.tp=2", "parallel.cp=2"],
    "cp2-dp2-a2a": ["parallel.cp=2", "parallel.cp_comm_type=a2a"],
    "tp4": ["parallel.tp=4"],
    "tp2-dp2-recompute-full": ["parallel.tp=2", "model.recompute=full"],
    "cp2-dp2-recompute-selective": ["parallel.cp=2", "model.recompute=selective"],
    "cp4-a2a+p2p-hcp2x2": ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hcp=[2,2]"],
}

# With dp = 1 a pipeline would default to 8 micro-batches of one sequence; 4 of two keep its gloo
# messages (~2 ms each on this 2-core machine) to what the dp = 2 layouts send.
FOUR_MICROBATCHES = "parallel.microbatches=4"
PIPELINE = {
    "tp2-pp2-1f1b": ["parallel.tp=2", "parallel.pp=2", FOUR_MICROBATCHES],
    "pp2-cp2-1f1b": ["parallel.pp=2", "parallel.cp=2", FOUR_MICROBATCHES],
    "pp2-dp2-interleaved-vpp2": ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"],
    "pp4-1f1b": ["parallel.pp=4", FOUR_MICROBATCHES],
    "pp2-dp2-gpipe": ["parallel.pp=2", "parallel.schedule=gpipe"],
    # zero-bubble W passes accumulate into ZeRO-2's in-place bucket views; DualPipeV under ZeRO-3
    "pp2-dp2-zb-h1-optim_grads": ["parallel.pp=2", "parallel.schedule=zb-h1", "parallel.zero=optim_grads"],
    "pp2-dp2-zb-v-optim": ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.zero=optim"],
    "pp2-dp2-dualpipev-optim_grads_params": ["parallel.pp=2", "parallel.schedule=dualpipev",
                                             "parallel.zero=optim_grads_params"],
}
# Uneven stages (Megatron's decoder_first_pipeline_num_layers), on the 8-layer model: rank 0 holds 2.
# Batches of 6: 3 micro-batches per dp rank, not a multiple of pp (interleaved's last group takes the rest).
EIGHT_LAYERS = ("model.layers=8", "train.global_batch=6", "train.micro_batch=1")
UNEVEN = {
    "pp2-dp2-zb-v-optim-uneven": ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.zero=optim",
                                  "parallel.first_stage_layers=2"],
    "pp2-dp2-interleaved-uneven": ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
                                   "parallel.first_stage_layers=2"],
}


# Without a pipeline, or with one layer per stage of a two-stage one, two layers show what four do
# (each layer runs the same collectives): half the TP and CP messages, which set the time of these
# runs on 2 cores. Four stages, or two chunks per stage, need the four.
TWO_LAYERS = ("model.layers=2",)
FOUR_LAYER_PIPELINES = ("pp2-dp2-interleaved-vpp2", "pp4-1f1b", "pp2-dp2-zb-v-optim",
                        "pp2-dp2-dualpipev-optim_grads_params")


@pytest.mark.parametrize("name", list(DENSE) + list(PIPELINE))
def test_dense_layout_matches_single_rank(dist_run, name):
    depth = () if name in FOUR_LAYER_PIPELINES else TWO_LAYERS
    results = dist_run(4, train_steps, None, list(depth) + (DENSE | PIPELINE)[name], timeout=900)
    assert_same(results, single_rank(dist_run, None, depth), TOLERANCE, name, noise(dist_run, None, depth))
    assert results[0][0][-1] < results[0][0][0]  # and it learns


# interleaved's uneven stages in the extended tier: zb-v's prove uneven stages, interleaved-vpp2 the schedule
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n == "pp2-dp2-interleaved-uneven" else n
                                  for n in UNEVEN])
def test_uneven_pipeline_layout_matches_single_rank(dist_run, name):
    results = dist_run(4, train_steps, None, list(EIGHT_LAYERS) + UNEVEN[name], timeout=900)
    assert_same(results, single_rank(dist_run, None, EIGHT_LAYERS), TOLERANCE, name,
                noise(dist_run, None, EIGHT_LAYERS))


# Tied input/output embeddings: one Parameter on the rank that holds both ends of the model (tp2,
# zb-v); over 1F1B's stages, copies on the first and last stage whose grads are summed (Megatron's).
TIED = {
    "tp2-dp2": ["parallel.tp=2"],
    "pp2-dp2-zb-v": ["parallel.pp=2", "parallel.schedule=zb-v"],
    "pp2-tp2-1f1b-zero1": ["parallel.pp=2", "parallel.tp=2", "parallel.schedule=1f1b", "parallel.zero=optim",
                           FOUR_MICROBATCHES],
}


@pytest.mark.parametrize("name", list(TIED))
def test_tied_embeddings_layout_matches_single_rank(dist_run, name):
    results = dist_run(4, train_steps, None, ["model.tie_embeddings=true"] + TIED[name], timeout=900)
    tied = ("model.tie_embeddings=true",)
    assert_same(results, single_rank(dist_run, None, tied), TOLERANCE, name, noise(dist_run, None, tied))


# Every balancing term on, each large enough to move the grad norm by far more than the tolerance,
# and the aux-free bias update: the switch and z losses over the global micro-batch, the sequence
# loss per sequence (seq_aux 1.0 is the strength that once drifted under ep2 x dp2).
MOE_BALANCING = ("model.aux_loss_coeff=0.01", "model.seq_aux_loss_coeff=1.0", "model.z_loss_coeff=0.001",
                 "model.bias_update_rate=0.001")
MOE = {
    "ep2-dp2": ["parallel.ep=2"],
    "ep4-optim_grads": ["parallel.ep=4", "parallel.zero=optim_grads"],
    "tp2-ep2-etp1": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
    # without SP the tp ranks hold the same tokens: each routes its 1/tp share of them (issue 53: every
    # expert once got each token from both tp ranks, its gradients twice the single rank's)
    "tp2-ep2-etp1-nosp": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "parallel.sequence_parallel=false"],
    "tp2-ep1-nosp": ["parallel.tp=2", "parallel.sequence_parallel=false"],  # experts copied over tp, each sees half
    "tp2-etp2-ep2": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2"],
    "cp2-dp2-ep2": ["parallel.cp=2", "parallel.ep=2"],
    "hsdp2x2-ep2": ["parallel.ep=2", "parallel.zero=optim_grads_params", "parallel.hsdp_replicas=2"],
    # static shapes (every expert padded to this rank's token count): the dropless math of one rank
    "tp2-ep2-padded": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "model.dispatcher=alltoall_padded"],
}
# Without a pipeline two layers (one dense, one MoE) show what four do, except for ep2 x dp2, the
# case that once drifted, kept at four (three MoE layers). The pipeline keeps four too, so the first
# stage holds a MoE layer and its balancing losses cross the stage boundary. Micro-batches of two
# sequences on the single rank too, so the pipeline's global micro-batches (dp = 1) are the single
# rank's: the balancing losses are per micro-batch.
MOE_FOUR_LAYERS = ("ep2-dp2",)
MOE_PIPELINE = {
    "tp2-pp2-ep2-1f1b": ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2", "parallel.etp=1"],
}


def moe_common(name: str) -> tuple[str, ...]:
    extra = ("train.micro_batch=2",) if name in MOE_PIPELINE else () if name in MOE_FOUR_LAYERS else TWO_LAYERS
    return MOE_BALANCING + extra


@pytest.mark.timeout(300)  # minutes under load on 2 cores: beyond the suite's 60 s bound
# tp2-ep2-etp1 without SP in the extended tier: tp2-ep1-nosp proves the tp ranks' routing shares without SP
# HSDP with ep2 (each HSDP replica a whole copy of the experts) in the extended tier too: ep2-dp2 proves its math
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n in ("tp2-ep2-etp1-nosp", "hsdp2x2-ep2")
                                  else n for n in list(MOE) + list(MOE_PIPELINE)])
def test_moe_layout_matches_single_rank(dist_run, moe_reference, name):
    """Each step of the layout from the single rank's state, at 1e-6 (moe_stepwise: flips reported)."""
    common = moe_common(name)
    root, reference = moe_reference(common)
    results = dist_run(4, layout_steps, "tiny-moe", list(common) + (MOE | MOE_PIPELINE)[name], root, timeout=900)
    assert_moe_steps_same(results, reference, TOLERANCE, name)
    assert reference[-1][0] < reference[0][0]  # and it learns


@pytest.mark.extended  # checks the stepwise comparison itself (robust to noise, not blind to a bug), not a layout
@pytest.mark.timeout(300)  # minutes under load on 2 cores: beyond the suite's 60 s bound
def test_moe_layouts_hold_under_last_bit_router_noise_and_catch_a_wrong_expert_order(dist_run, moe_reference):
    """Router logits x (1 + 2**-23) on the layout's ranks (another CPU's rounding, exaggerated to
    every score): still the single rank's steps. The same layout with its local experts' token
    counts reversed (a wrong expert permutation under EP) fails."""
    name = "tp2-pp2-ep2-1f1b"
    common = moe_common(name)
    root, reference = moe_reference(common)
    layout = list(common) + MOE_PIPELINE[name]
    perturbed = dist_run(4, layout_steps, "tiny-moe", layout, root, perturb=2.0 ** -23, timeout=900)
    assert_moe_steps_same(perturbed, reference, TOLERANCE, name + " perturbed")
    planted = dist_run(4, layout_steps, "tiny-moe", layout, root, bug="reversed_expert_counts", steps=PLANTED_STEPS,
                       timeout=900)
    with pytest.raises(AssertionError) as caught:
        assert_moe_steps_same(planted, reference, TOLERANCE, name + " planted bug")
    print(f"reversed_expert_counts: {str(caught.value).splitlines()[0]}")


# A placement only changes which process plays which grid position: the same model trains.
# Two hosts of two NVLink-connected GPUs; "interleaved": the launcher numbered the hosts' GPUs alternately.
TOPOLOGY = '''name = "{name}"
hosts = ["a", "b"]
[bandwidth]
nvlink = 450.0
pcie = 64.0
network = 50.0
''' + "".join(f"[[gpus]]\nnode = {{n{r}}}\nlocal = {{l{r}}}\ndomain = {{n{r}}}\n" for r in range(4))
PLACED = {  # name: (nodes of ranks 0..3, layout, what the placement must change)
    "tp2-pp2-order": ([0, 0, 1, 1], ["parallel.tp=2", "parallel.pp=2", "parallel.order=pp-tp-cp-ep-dp",
                                     FOUR_MICROBATCHES], "order"),
    "tp2-dp2-permuted": ([0, 1, 0, 1], ["parallel.tp=2"], "permutation"),
}


def placed_train_steps(overrides):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config(None, list(COMMON) + list(overrides)))
    results = [trainer.train_step(step) for step in range(STEPS)]
    p = trainer.assignment
    return ([r.loss for r in results], [r.grad_norm for r in results]), p.grid.order, p.permutation, p.message


@pytest.mark.parametrize("name", list(PLACED))
def test_placed_layout_matches_single_rank(dist_run, tmp_path, name):
    nodes, layout, changes = PLACED[name]
    local = [nodes[:r].count(nodes[r]) for r in range(4)]
    path = tmp_path / "cluster.toml"
    path.write_text(TOPOLOGY.format(name=name, **{f"n{r}": nodes[r] for r in range(4)},
                                    **{f"l{r}": local[r] for r in range(4)}))
    results = dist_run(4, placed_train_steps, list(TWO_LAYERS) + layout + [f"topology.file={path}"], timeout=900)
    for _, order, permutation, message in results:
        assert "network: tp" not in message, message
        if changes == "order":
            assert order != "pp-tp-cp-ep-dp" and permutation is None, message
        else:
            assert permutation is not None, message
    assert_same([losses for losses, *_ in results], single_rank(dist_run, None, TWO_LAYERS), TOLERANCE, name,
                noise(dist_run, None, TWO_LAYERS))


# Packed documents (document_mask + reset_position_ids + eod_mask_loss) on short documents, so each
# 32-token sequence holds several: per-sequence boundaries through Ulysses with dp, and through
# TP x EP with MoE (tests/test_packed_documents.py anchors the single rank to each document alone,
# and checks CP modes and TP x PP against it).
PACKED_KEYS = ("data.document_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true")
PACKED = {
    "packed-cp2-dp2-a2a": (None, TWO_LAYERS, ["parallel.cp=2", "parallel.cp_comm_type=a2a"]),
}
PACKED_MOE = ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"]


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory):
    from test_packed_documents import packed_dataset

    return packed_dataset(tmp_path_factory.mktemp("packed") / "docs")


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_layout_matches_single_rank(dist_run, packed_data, name):
    config, common, layout = PACKED[name]
    common = (f"data.path={packed_data}",) + PACKED_KEYS + common
    results = dist_run(4, train_steps, config, list(common) + layout, timeout=900)
    assert_same(results, single_rank(dist_run, config, common), TOLERANCE, name, noise(dist_run, config, common))


def test_packed_moe_layout_matches_single_rank(dist_run, packed_data, moe_reference):
    """Packed documents through TP x EP: each step from the single rank's state, as the MoE layouts."""
    common = (f"data.path={packed_data}",) + PACKED_KEYS + MOE_BALANCING + TWO_LAYERS
    root, reference = moe_reference(common)
    results = dist_run(4, layout_steps, "tiny-moe", list(common) + PACKED_MOE, root, timeout=900)
    assert_moe_steps_same(results, reference, TOLERANCE, "packed-tp2-ep2-moe")
