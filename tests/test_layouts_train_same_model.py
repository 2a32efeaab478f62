"""Any layout trains the same model: 10 fp32 steps of tiny.toml (and tiny-moe.toml) under many
layouts give the same loss at every step as the single-rank run (relative error <= 1e-4).

The global gradient norm of every step is compared too: AdamW is blind to a constant scale on a
parameter's gradient, so losses alone would not catch a mis-scaled gradient reduction."""

import functools

import pytest

STEPS = 10
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=2", "train.eval_every=0", "log.progress=false"]


def train_losses(config, overrides):
    from pretrain.config import load_config
    from pretrain.train_loop import Trainer

    cfg = load_config(config, COMMON + list(overrides))
    trainer = Trainer(cfg)
    results = [trainer.train_step(step) for step in range(STEPS)]
    return [r.loss for r in results], [r.grad_norm for r in results]


@functools.cache
def single_rank(config):
    from par_groups.testing import RankPool

    pool = RankPool(1)
    try:
        return pool.run(train_losses, config, [])[0]
    finally:
        pool.close()


DENSE = {
    "dp4": ["parallel.zero=no_shard"],
    "dp4-optim": ["parallel.zero=optim"],
    "dp4-optim_grads": ["parallel.zero=optim_grads"],
    "dp4-optim_grads_params": ["parallel.zero=optim_grads_params"],
    "dp4-torch_fsdp2": ["parallel.zero=torch_fsdp2"],
    "hsdp2x2-optim_grads_params": ["parallel.zero=optim_grads_params", "parallel.hsdp_replicas=2"],
    "tp2-dp2-sp": ["parallel.tp=2"],
    "tp2-cp2": ["parallel.tp=2", "parallel.cp=2"],
    "cp2-dp2-a2a": ["parallel.cp=2", "parallel.cp_comm_type=a2a"],
    "tp4-optim": ["parallel.tp=4", "parallel.zero=optim"],
    "tp2-dp2-recompute-full": ["parallel.tp=2", "model.recompute=full"],
    "cp2-dp2-recompute-selective": ["parallel.cp=2", "model.recompute=selective"],
    "cp4-a2a+p2p-hcp2x2": ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hcp=[2,2]"],
}


def _check(result, reference):
    (losses, norms), (ref_losses, ref_norms) = result, reference
    assert len(losses) == len(ref_losses) == STEPS
    for step in range(STEPS):
        assert abs(losses[step] - ref_losses[step]) <= 1e-4 * abs(ref_losses[step]), \
            f"step {step}: loss {losses[step]} vs single-rank {ref_losses[step]}"
        assert abs(norms[step] - ref_norms[step]) <= 1e-4 * abs(ref_norms[step]), \
            f"step {step}: grad norm {norms[step]} vs single-rank {ref_norms[step]}"


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_layout_matches_single_rank(dist_run, name):
    results = dist_run(4, train_losses, None, DENSE[name], timeout=600)
    for rank_losses in results:  # every rank reports the same global loss
        _check(rank_losses, single_rank(None))
    assert results[0][0][-1] < results[0][0][0]  # and it learns


# Batch-level balancing losses depend on how tokens are grouped into micro-batches per rank, so the
# equivalence runs use the sequence-wise loss (per sequence: the same under every layout) instead.
MOE_COMMON = ["model.aux_loss_coeff=0.0", "model.seq_aux_loss_coeff=0.01", "model.bias_update_rate=0.001"]
MOE = {
    "ep2-dp2": ["parallel.ep=2"],
    "ep4-optim_grads": ["parallel.ep=4", "parallel.zero=optim_grads"],
    "tp2-ep2-etp1": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
    "tp2-etp2-ep2": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2"],
}


@pytest.mark.parametrize("name", list(MOE))
def test_moe_layout_matches_single_rank(dist_run, name):
    results = dist_run(4, train_losses, "tiny-moe", MOE_COMMON + MOE[name], timeout=600)
    reference = single_rank_with("tiny-moe", tuple(MOE_COMMON))
    for rank_losses in results:
        _check(rank_losses, reference)


@functools.cache
def single_rank_with(config, overrides):
    from par_groups.testing import RankPool

    pool = RankPool(1)
    try:
        return pool.run(train_losses, config, list(overrides))[0]
    finally:
        pool.close()


PIPELINE = {
    "tp2-pp2": ["parallel.tp=2", "parallel.pp=2"],
    "pp2-cp2": ["parallel.pp=2", "parallel.cp=2"],
    "pp4-interleaved": ["parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved"],
    # uneven stages (Megatron's decoder_first_pipeline_num_layers): rank 0 holds 2 of the 8 layers
    "pp2-dp2-zb-v-optim-uneven": ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.zero=optim",
                                  "parallel.first_stage_layers=2"],
    "pp2-dp2-interleaved-uneven": ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
                                   "parallel.first_stage_layers=2"],
    "pp2-dp2-dualpipev": ["parallel.pp=2", "parallel.schedule=dualpipev"],
    "pp2-dp2-zb-h1-gpipe": ["parallel.pp=2", "parallel.schedule=zb-h1"],
}

# Tied input/output embeddings: one Parameter, on the rank that holds both ends of the model.
TIED = {
    "tp2-dp2": ["parallel.tp=2"],
    "pp2-dp2-zb-v": ["parallel.pp=2", "parallel.schedule=zb-v"],
}


@pytest.mark.parametrize("name", list(TIED))
def test_tied_embeddings_layout_matches_single_rank(dist_run, name):
    results = dist_run(4, train_losses, None, ["model.tie_embeddings=true"] + TIED[name], timeout=600)
    reference = single_rank_with(None, ("model.tie_embeddings=true",))
    for rank_losses in results:
        _check(rank_losses, reference)


@pytest.mark.parametrize("name", list(PIPELINE))
def test_pipeline_layout_matches_single_rank(dist_run, name):
    results = dist_run(4, train_losses, None, PIPELINE[name], timeout=600)
    for rank_losses in results:
        _check(rank_losses, single_rank(None))


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
    "tp2-pp2-order": ([0, 0, 1, 1], ["parallel.tp=2", "parallel.pp=2", "parallel.order=pp-tp-cp-ep-dp"], "order"),
    "tp2-dp2-permuted": ([0, 1, 0, 1], ["parallel.tp=2"], "permutation"),
}


def placed_train_losses(overrides):
    from pretrain.config import load_config
    from pretrain.train_loop import Trainer

    trainer = Trainer(load_config(None, COMMON + list(overrides)))
    results = [trainer.train_step(step) for step in range(STEPS)]
    p = trainer.placement
    return ([r.loss for r in results], [r.grad_norm for r in results]), p.grid.order, p.permutation, p.message


@pytest.mark.parametrize("name", list(PLACED))
def test_placed_layout_matches_single_rank(dist_run, tmp_path, name):
    nodes, layout, changes = PLACED[name]
    local = [nodes[:r].count(nodes[r]) for r in range(4)]
    path = tmp_path / "cluster.toml"
    path.write_text(TOPOLOGY.format(name=name, **{f"n{r}": nodes[r] for r in range(4)},
                                    **{f"l{r}": local[r] for r in range(4)}))
    results = dist_run(4, placed_train_losses, layout + [f"topology.file={path}"], timeout=600)
    for losses, order, permutation, message in results:
        assert "network: tp" not in message, message
        if changes == "order":
            assert order != "pp-tp-cp-ep-dp" and permutation is None, message
        else:
            assert permutation is not None, message
        _check(losses, single_rank(None))
