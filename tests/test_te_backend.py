"""``[model].backend='te'`` (and ``[train].fp8``) trains the same model as the PyTorch backend, on
the CPU, with Transformer Engine replaced by a stand-in of the same API (tests/te_standin.py; the
real library needs CUDA). What this proves is the trainer's TE wiring: TE's Linear borrows our
weights and their gradients reach par-zero's buckets; TE's attention gets sequence-first shards of
the layout TE's CP expects, the model's softmax scale and CP groups; one FP8 region per chunk
forward, its amaxes reduced over tp x dp x cp; recomputation through TE's checkpoint, inside FP8.

Each layout runs both backends on the same ranks for STEPS fp32 steps and compares the loss
and global grad norm at every step. The matmuls are the same; attention differs in how it sums
(the stand-in takes all keys at once, par-cp goes block by block), and the fused norms' grads are
summed over TP. Measured (`pytest -s` prints each): at most 1.1e-7, but for step 4 of the MLA run
at 1.17e-6, where the single rank moves by 1.29e-6 when only its micro-batching changes; so 1e-6
as in the layout tests, a step past it judged against that noise (layout_runs.assert_close_steps).
"""

import pytest
import torch.distributed as dist

import layout_runs

STEPS = 5
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
          "model.layers=4", "train.seq_len=32"]
RTOL = 1e-6
MLA = ["model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6",
       'model.rope_scaling={rope_type = "yarn", factor = 40, original_max_position_embeddings = 4096, mscale = 1.0, '
       'mscale_all_dim = 1.0}']  # DeepSeek-V3's YaRN: its softmax scale is not 1/sqrt(d)
LAYOUTS = {  # world 2 or 4; each adds one thing TE must be given right
    "tp2-sp": ["parallel.tp=2"],
    "cp2-p2p-recompute-selective": ["parallel.cp=2", "model.recompute=selective"],
    "cp2-dp2-a2a": ["parallel.cp=2", "parallel.cp_comm_type=a2a"],
    "cp4-a2a+p2p-hcp2x2": ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hcp=[2,2]"],
    "cp2-allgather-mla": ["parallel.cp=2", "parallel.cp_comm_type=allgather"] + MLA,
    # fp8: 4 micro-batches, each chunk forward its own FP8 region; full recompute re-enters FP8
    # without SP the fused norms are still partial over TP: they run after the TP entry
    "tp2-pp2-1f1b-no-sp-fp8-delayed-recompute-full": ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=1f1b",
                                                      "parallel.sequence_parallel=false", "parallel.microbatches=4",
                                                      "train.fp8=delayed", "model.recompute=full"],
    "dp2-torch-fsdp2": ["parallel.zero=torch_fsdp2"],
    "dp2-zero3": ["parallel.zero=optim_grads_params"],
    "dp2-fp8-current-mtp": ["train.fp8=current", "train.micro_batch=2", "model.mtp_depth=1"],
    # MoE layers keep their norm before the router (only dense layers fuse the MLP's norm)
    "tp2-ep2-moe-fp8-delayed": ["parallel.tp=2", "parallel.ep=2", "train.fp8=delayed", "train.micro_batch=2",
                                "model.layers=2"],
}
CONFIG = {"tp2-ep2-moe-fp8-delayed": "tiny-moe"}
WORLD = {"cp4-a2a+p2p-hcp2x2": 4, "cp2-dp2-a2a": 4, "tp2-pp2-1f1b-no-sp-fp8-delayed-recompute-full": 4,
         "tp2-ep2-moe-fp8-delayed": 4}


def train(config, overrides, backend: str):
    """(losses, grad norms, trainer) of STEPS steps with this backend; runs on every rank."""
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config(config, COMMON + list(overrides) + [f"model.backend={backend}"]))
    results = [trainer.train_step(step) for step in range(STEPS)]
    return [r.loss for r in results], [r.grad_norm for r in results], trainer


def pytorch_backend(config, overrides):
    """The PyTorch backend's (losses, grad norms), FP8 left out (it runs in TE's layers only)."""
    return train(config, [o for o in overrides if not o.startswith("train.fp8=")], "torch")[:2]


def te_backend(config, overrides):
    """The TE backend's (losses, grad norms) on the stand-in, and what the stand-in saw."""
    import te_standin
    from par_tp import ColumnParallelLinear, RowParallelLinear
    from pretrain.blocks.te import TELinearKernel

    with te_standin.installed() as record:
        losses, norms, trainer = train(config, overrides, "te")
        amax_ranks = {tuple(sorted(dist.get_process_group_ranks(r.group))) for r in record.regions if r.group}
        seen = dict(linear_calls=record.linear_calls, norm_linear_calls=record.norm_linear_calls, fp8_linear_calls=record.fp8_linear_calls,
                    attention_calls=record.attention_calls, checkpoints=record.checkpoints,
                    fp8_regions=sum(r.enabled and not r.recompute for r in record.regions),
                    recomputes_in_fp8=sum(r.recompute for r in record.regions),
                    cp_comm_types=sorted(record.cp_comm_types), amax_ranks=sorted(amax_ranks),
                    expected_amax_ranks=[tuple(sorted(dist.get_process_group_ranks(trainer.groups.tp_dp_cp)))],
                    te_state=[n for n in trainer.model.full_named_tensors() if "extra_state" in n],
                    torch_matmuls=sorted(name for chunk in trainer.model.chunks.values()
                                         for name, m in chunk.named_modules()
                                         if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                                         and not isinstance(m.linear_kernel, TELinearKernel)))
    return (losses, norms), seen


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_te_backend_trains_the_same_model_as_pytorch(dist_run, name):
    overrides, world, config = LAYOUTS[name], WORLD.get(name, 2), CONFIG.get(name)
    references = dist_run(world, pytorch_backend, config, overrides, timeout=600)
    results = dist_run(world, te_backend, config, overrides, timeout=600)
    settings = dict(o.split("=", 1) for o in overrides)
    fp8, recompute = "train.fp8" in settings, "model.recompute" in settings
    # a step past RTOL is judged against the single rank's own rounding noise there (layout_runs);
    # not for MoE, whose balancing losses change with the micro-batching that noise measures
    model_only = [o for o in overrides if not o.startswith("parallel.")]
    noise = None if config == "tiny-moe" else layout_runs.deferred_noise(dist_run, config, model_only, pytorch_backend)
    for reference, (te_run, seen) in zip(references, results):
        layout_runs.assert_close_steps(te_run, reference, RTOL, f"te {name}", noise, steps=STEPS)
        assert seen["linear_calls"] > 0 and seen["attention_calls"] > 0, seen
        assert seen["norm_linear_calls"] > 0, seen  # every layout has a fused norm (GQA's or a dense MLP's)
        assert seen["te_state"] == [], seen  # TE's modules stay out of the checkpointed tensors
        assert seen["torch_matmuls"] in ([], ["lm_head"]), seen  # the output layer stays out of TE (and FP8)
        if "parallel.cp" in settings:  # TE's name for each cp_comm_type
            mode = settings.get("parallel.cp_comm_type", "p2p")
            assert seen["cp_comm_types"] == [{"allgather": "all_gather"}.get(mode, mode)], seen
        assert (seen["checkpoints"] > 0) == recompute, seen
        if fp8:
            assert seen["fp8_linear_calls"] > 0 and seen["fp8_regions"] > 0, seen
            assert seen["amax_ranks"] == seen["expected_amax_ranks"], seen  # tp x dp x cp, never the world
            assert (seen["recomputes_in_fp8"] > 0) == recompute, seen
        else:
            assert seen["fp8_linear_calls"] == 0 and seen["fp8_regions"] == 0, seen

