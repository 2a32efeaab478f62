"""[model].recompute as a list of modules (blocks/recompute_policy.py): every policy trains bit for bit
as the policy-free run of the same layout (its recomputed forward is the original), and a MoE step
with recompute routes, and counts, the same pairs."""

import pytest

STEPS = 2
COMMON = ("model.layers=2", f"train.steps={STEPS}", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false")
DENSE = {"tp2-sp": ["parallel.tp=2"]}
# the aux-free bias update on: each step's load decides the next step's routing
MOE = {"ep2": ["parallel.ep=2", "model.bias_update_rate=0.01", "model.seq_aux_loss_coeff=0.1", "model.z_loss_coeff=0.001"]}
DENSE_POLICIES = ('["core_attn", "mlp", "layernorm"]', '["full@0", "mlp@1"]')
MOE_POLICIES = ('["moe", "layernorm"]', '["moe_act", "core_attn"]', '"full"')
MLA = ["model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.mtp_depth=1"]
EXTENDED = {  # the same proof through the other layouts' recomputed collectives and schedules
    "cp2": (None, ["parallel.cp=2"], DENSE_POLICIES),
    "pp2-zbv": (None, ["parallel.pp=2", "parallel.schedule=zb-v", "train.micro_batch=1", "model.layers=4"], DENSE_POLICIES),
    "zero3": (None, ["parallel.zero=optim_grads_params"], DENSE_POLICIES),
    "tp2-sp-ep2": ("tiny-moe", ["parallel.tp=2", "parallel.ep=2", "model.bias_update_rate=0.01"], MOE_POLICIES),
    "mla-mtp-tp2-sp": (None, MLA + ["parallel.tp=2"], ('["mla_up_proj", "layernorm"]', '["mla_up_proj@0", "core_attn@1-2"]')),
}


def runs(config, overrides, policies):
    """(losses, grad norms, each MoE layer's routed pairs per expert at each bias update) per policy."""
    import torch
    from par_moe import MoELayer

    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    loads, routed_load = [], MoELayer.routed_load

    def counted(self, *groups):  # this rank's pairs since the last update, before they are summed
        loads.append(self.routed_since_update.clone())
        return routed_load(self, *groups)

    MoELayer.routed_load = counted
    out = []
    try:
        for policy in ("none", *policies):
            loads.clear()
            t = Trainer(load_config(config, list(COMMON) + list(overrides) + [f"model.recompute={policy}"]))
            steps = [t.train_step(s) for s in range(STEPS)]
            out.append(([r.loss for r in steps], [r.grad_norm for r in steps], [x.tolist() for x in loads]))
    finally:
        MoELayer.routed_load = routed_load
    torch.distributed.barrier()
    return out


def assert_bitwise(results, policies):
    for rank in results:
        reference, *others = rank
        for policy, got in zip(policies, others):
            assert got == reference, f"recompute={policy}: {got} != {reference}"


@pytest.mark.timeout(300)
def test_module_policies_train_bitwise_as_no_recompute_under_tp2_sp_and_ep2(dist_run):
    dense = dist_run(2, runs, None, DENSE["tp2-sp"], DENSE_POLICIES)
    assert_bitwise(dense, DENSE_POLICIES)
    moe = dist_run(2, runs, "tiny-moe", MOE["ep2"], MOE_POLICIES)
    assert_bitwise(moe, MOE_POLICIES)
    assert moe[0][0][2] and sum(moe[0][0][2][0]) > 0  # the loads were compared


@pytest.mark.extended
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(EXTENDED))
def test_module_policies_train_bitwise_under_cp2_pp2_zbv_zero3(dist_run, name):
    config, overrides, policies = EXTENDED[name]
    world = 4 if name == "tp2-sp-ep2" else 2
    assert_bitwise(dist_run(world, runs, config, overrides, policies), policies)


def counted_runs(config, overrides, policies):
    """Per policy: (losses, grad norms, regions checkpointed in the steps: torch's checkpoint calls)."""
    import torch

    from pretrain.config import load_config
    from pretrain.blocks import te
    from pretrain.models.gpt_oss import moe as gpt_oss_moe
    from pretrain.training.train_loop import Trainer

    calls = [0]
    patched = [(m, m.checkpoint) for m in (te, gpt_oss_moe) if hasattr(m, "checkpoint")]

    def counting(original):
        def checkpoint(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)
        return checkpoint

    for module, original in patched:
        module.checkpoint = counting(original)
    out = []
    try:
        for policy in ("none", *policies):
            t = Trainer(load_config(config, list(COMMON) + list(overrides) + [f"model.recompute={policy}"]))
            calls[0] = 0
            steps = [t.train_step(s) for s in range(STEPS)]
            out.append(([r.loss for r in steps], [r.grad_norm for r in steps], calls[0]))
    finally:
        for module, original in patched:
            module.checkpoint = original
    torch.distributed.barrier()
    return out


# the newer families' own cores: gpt-oss's sink attention (and its clamped SwiGLU for moe_act), Qwen3-Next's
# gated attention and Gated DeltaNet (conv, gates and delta rule)
FAMILIES = {
    "gpt-oss-tp2": ("tiny-moe", ["model.attention=gpt_oss", "model.heads=4", "model.kv_heads=2", "model.kv_channels=16",
                                 "model.moe_layers_start=0", "model.shared_experts=0", "model.num_experts=4",
                                 "model.top_k=2", "model.moe_ffn_hidden=32", "model.norm_topk_prob=true",
                                 "parallel.tp=2", "parallel.etp=1"], ('["core_attn"]', '["moe_act"]')),
    "qwen3-next-tp2": (None, ["model.attention=qwen3_next", "model.full_attention_interval=2",
                              "model.partial_rotary_factor=0.5", "model.heads=4", "model.kv_heads=2",
                              "model.linear_key_heads=2", "model.linear_value_heads=4", "model.linear_key_dim=8",
                              "model.linear_value_dim=8", "parallel.tp=2"], ('["core_attn"]',)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_newer_families_recompute_their_cores_bitwise(dist_run, name):
    """core_attn (and gpt-oss's moe_act) rerun in every layer of each micro-batch, and train bit for bit
    as the policy-free run (on the 2 layers: qwen3-next's first a Gated DeltaNet, its second gated attention)."""
    config, overrides, policies = FAMILIES[name]
    for rank in dist_run(2, counted_runs, config, overrides, policies):
        (losses, norms, none), *others = rank
        assert none == 0
        for policy, got in zip(policies, others):
            assert got[:2] == (losses, norms), policy
            assert got[2] == 2 * STEPS, (policy, got[2])  # each of the 2 layers, one micro-batch a step
