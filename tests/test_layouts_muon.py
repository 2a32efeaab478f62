"""[train].optimizer = "muon" trains the same model under layouts: Newton-Schulz sees whole matrices.

Dense layouts: 20 fp32 steps (Newton-Schulz in fp32: ``muon_ns_dtype=fp32``; bf16 would round a
last-bit difference of the summed gradients to a whole bf16 step) give the single rank's loss and
grad norm at every step at 1e-6 (layout_runs.assert_same): a step's update moves every later loss, so
a wrong piece of a matrix (a ZeRO range, a TP shard orthogonalized alone) fails from step 1 on.

MoE (ep2): routing flips make whole trajectories incomparable (moe_stepwise), and its step-by-step
comparison checks a step's loss and grad norm, not the update. So here each step of the layout starts
from the single rank's checkpoint of that step (resharded), steps once, and saves: its params and
Muon momentum after the step must equal the single rank's checkpoint of the next step at 1e-6.
"""

import os

import pytest
import torch

from layout_runs import assert_same, single_rank, train_steps
from layout_runs import deferred_noise as noise

TOLERANCE = 1e-6
MUON = ("train.optimizer=muon", "train.muon_ns_dtype=fp32", "model.layers=2")
DENSE = {  # name: (world, overrides)
    "dp2-no_shard": (2, ["parallel.zero=no_shard"]),
    "dp4-optim": (4, ["parallel.zero=optim"]),
    "dp4-optim_grads_params": (4, ["parallel.zero=optim_grads_params"]),
    "dp4-hsdp2": (4, ["parallel.zero=optim_grads_params", "parallel.hsdp_replicas=2"]),  # owners per replica
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2", "parallel.microbatches=4"]),
    "cp2-dp2": (4, ["parallel.cp=2"]),  # the update is the same whichever ranks held which tokens
}


@pytest.mark.parametrize("name", list(DENSE))
def test_muon_layout_matches_single_rank(dist_run, name):
    world, overrides = DENSE[name]
    results = dist_run(world, train_steps, None, list(MUON) + overrides, timeout=900)
    assert_same(results, single_rank(dist_run, None, MUON), TOLERANCE, name, noise(dist_run, None, MUON))
    assert results[0][0][-1] < results[0][0][0]


# The whole dense layout matrix (tests/test_layouts_train_same_model.py's DENSE and PIPELINE, as it runs
# them, torch_fsdp2 aside: Muon is par-zero's own, over its buckets) under Muon: about 4 minutes on 2
# cores, so outside the default suite, which keeps the layouts above. PAR_FULL_MATRIX=1 runs it.
def _whole_matrix():
    from test_layouts_train_same_model import DENSE as MATRIX, FOUR_LAYER_PIPELINES, PIPELINE

    return {name: (["model.layers=4"] if name in FOUR_LAYER_PIPELINES else []) + overrides
            for name, overrides in (MATRIX | PIPELINE).items() if "torch_fsdp2" not in name}


@pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason="the whole dense matrix under Muon: PAR_FULL_MATRIX=1")
@pytest.mark.parametrize("name", list(_whole_matrix()))
def test_muon_whole_dense_matrix_matches_single_rank(dist_run, name):
    overrides = _whole_matrix()[name]
    depth = [o for o in overrides if o.startswith("model.layers")]
    common = [o for o in MUON if not (depth and o.startswith("model.layers"))] + depth
    results = dist_run(4, train_steps, None, common + overrides, timeout=900)
    assert_same(results, single_rank(dist_run, None, tuple(common)), TOLERANCE, name, noise(dist_run, None, tuple(common)))


MOE_STEPS = 6
MOE = ("train.optimizer=muon", "train.muon_ns_dtype=fp32", "model.layers=2", "model.bias_update_rate=0.001",
       f"train.steps={MOE_STEPS}", "train.warmup_steps=2", "train.eval_every=0", "log.progress=false",
       "train.seq_len=32", "train.collective_timeout_s=40")


def _trainer(overrides):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    return Trainer(load_config("tiny-moe", list(MOE) + list(overrides)))


def moe_reference(root: str, model=()) -> None:
    """The single rank's steps, saving ``root/step_s`` before step s (and after the last); ``model``: overrides."""
    trainer = _trainer(model)
    for step in range(MOE_STEPS):
        trainer.save_checkpoint(root, step, keep=MOE_STEPS + 2)
        trainer.train_step(step)
    trainer.save_checkpoint(root, MOE_STEPS, keep=MOE_STEPS + 2)


def moe_layout_updates(overrides, root: str, mine: str) -> dict:
    """Each step from the reference's checkpoint, once, saved to ``mine``; per step the largest
    relative error (norm) of the params and of the Muon momentum against the reference's next checkpoint."""
    from pretrain.checkpoint.full_model import read_full_tensors

    trainer = _trainer(overrides)
    out = {}
    for step in range(MOE_STEPS):
        assert trainer.load_checkpoint(f"{root}/step_{step}") == step
        trainer.train_step(step)
        trainer.save_checkpoint(mine, step + 1, keep=MOE_STEPS + 2)
        errors = {}  # read_full_tensors loads through torch.distributed.checkpoint: every rank reads
        for prefix in ("model/", "optim/momentum_buffer/"):
            want, got = (read_full_tensors(f"{r}/step_{step + 1}", prefix) for r in (root, mine))
            assert sorted(want) == sorted(got) and want, prefix
            errors[prefix] = max(((got[k].double() - want[k].double()).norm() /
                                  want[k].double().norm().clamp_min(1e-30)).item() for k in want)
        out[step] = errors
    return out


MOE_LAYOUTS = {"ep2": (2, ["parallel.ep=2"]), "tp2-etp2-ep2": (4, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2"]),
               "cp2-ep2": (2, ["parallel.cp=2", "parallel.ep=2"]),
               "ep2-optim_grads_params": (4, ["parallel.ep=2", "parallel.zero=optim_grads_params"])}
# the Qwen3-Next hybrid's MoE (Gated DeltaNet layers, the sigmoid-gated shared expert): opt-in, its dense
# Muon layouts are tests/test_layouts_qwen3_next.py's
QWEN3_NEXT_MOE = ("model.attention=qwen3_next", "model.full_attention_interval=2", "model.partial_rotary_factor=0.5",
                  "model.heads=4", "model.kv_heads=2", "model.linear_key_heads=2", "model.linear_value_heads=4",
                  "model.linear_key_dim=8", "model.linear_value_dim=8", "model.moe_layers_start=0")


@pytest.mark.parametrize("name, model", [(n, ()) for n in MOE_LAYOUTS] + [
    pytest.param(f"qwen3-next-{n}", QWEN3_NEXT_MOE, marks=pytest.mark.extended) for n in ("ep2", "ep2-optim_grads_params")])
def test_muon_moe_layout_update_matches_single_rank(dist_run, tmp_path, name, model):
    world, overrides = MOE_LAYOUTS[name.removeprefix("qwen3-next-")]
    root = str(tmp_path / "reference")
    dist_run(1, moe_reference, root, model, timeout=600)
    errors = dist_run(world, moe_layout_updates, [*model, *overrides], root, str(tmp_path / "layout"), timeout=900)[0]
    worst = {k: max(e[k] for e in errors.values()) for k in ("model/", "optim/momentum_buffer/")}
    print(f"{name}: max rel error after a step: params {worst['model/']:.1e} momentum {worst['optim/momentum_buffer/']:.1e}")
    assert len(errors) == MOE_STEPS and all(e <= TOLERANCE for e in worst.values()), errors
    assert torch.isfinite(torch.tensor(list(worst.values()))).all()
