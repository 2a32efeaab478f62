"""The trainer's single-rank run equals plain PyTorch training of the reference model.

The layout tests compare every layout with the trainer's own single-rank run; this one anchors
that run to an independent computation: `LlamaReference` (nn.Linear, SDPA, nn.RMSNorm, par-moe's
loop-over-experts `ReferenceMoE` with its balancing losses added to the loss), the same batches,
`torch.optim.AdamW` with two param groups (no weight decay on norms and the embedding; or the
torch.optim class `[train].optimizer` names: SGD with momentum under tp2),
`torch.nn.utils.clip_grad_norm_`, the same LR schedule, and for MoE the aux-free bias update
written out here (``bias += rate * sign(mean load - load)``).
fp32, 6 steps: loss within 1.1e-7 and grad norm within 4.3e-7 (relative) measured, so 1e-6.
"""

import pytest
import torch
import torch.nn.functional as F

STEPS = 6
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=2", "train.eval_every=0", "log.progress=false",
          "model.layers=2", "train.grad_clip=0.5"]


# every balancing term and the bias update on, each large enough to show in the grad norm
MOE = ["model.layers=3", "model.aux_loss_coeff=0.01", "model.seq_aux_loss_coeff=1.0", "model.z_loss_coeff=0.001",
       "model.bias_update_rate=0.001"]


def count_routed(moe, load):
    """Wrap ``moe.route`` to add each forward's routed pairs per expert to ``load``."""
    route = moe.route

    def counting(tokens):
        out = route(tokens)
        load.add_(torch.bincount(out[2].reshape(-1), minlength=load.numel()))
        return out

    moe.route = counting


def mean_of_microbatches(model, sampler, step: int) -> tuple[torch.Tensor, float]:
    """(what to backward, the logged loss) of one rank's step: the mean over micro-batches of each
    one's mean token loss, plus the MoE balancing losses."""
    batch = sampler.train_batch(step)
    n, total, logged = batch.tokens.shape[0], 0.0, 0.0
    for m in range(n):
        logits, aux = model(batch.inputs[m].t())
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels[m].t().flatten())
        total = total + (loss + aux) / n
        logged += loss.item() / n
    return total, logged


def trainer_and_plain_pytorch(config, overrides, plain_loss=mean_of_microbatches, steps=STEPS):
    from pretrain.config import load_config
    from pretrain.model.reference import build_reference
    from pretrain.schedule_lr import lr_at
    from pretrain.train_loop import Trainer

    cfg = load_config(config, COMMON + list(overrides))
    trainer = Trainer(cfg)
    ours = [trainer.train_step(step) for step in range(steps)]

    t = cfg.train
    model = build_reference(cfg.model, t.seed)
    named = dict(model.named_parameters())  # tied weights once
    params = list(named.values())
    # two groups, as nanoGPT and Megatron: no weight decay on norms, biases and the embedding
    plain_decay = [p for n, p in named.items() if p.dim() >= 2 and n != "model.embed_tokens.weight"]
    groups = [{"params": plain_decay}, {"params": [p for p in params if all(p is not q for q in plain_decay)], "weight_decay": 0.0}]
    if t.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay)
    else:  # [train].optimizer names a torch.optim class: that class, the same two groups
        opt = getattr(torch.optim, t.optimizer_class)(groups, lr=t.lr, weight_decay=t.weight_decay, **t.optimizer_args)
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "route")]
    loads = [torch.zeros(m.config.num_experts, dtype=torch.int64) for m in moes]
    for moe, load in zip(moes, loads):
        count_routed(moe, load)
    plain = []
    for step in range(steps):
        loss, logged = plain_loss(model, trainer.sampler, step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, steps=t.steps)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for moe, load in zip(moes, loads):
                moe.router.expert_bias += cfg.model.bias_update_rate * torch.sign(load.double().mean() - load)
                load.zero_()
        plain.append((logged, float(norm)))
    return [(r.loss, r.grad_norm) for r in ours], plain


# SGD: lr large enough that the weight-decay mask moves the loss well beyond the tolerance
SGD = ["train.optimizer=sgd", "train.optimizer_args={momentum=0.9, nesterov=true}", "train.lr=0.3", "train.min_lr=0.03"]
CASES = {"dense": (None, []), "tied": (None, ["model.tie_embeddings=true"]), "moe": ("tiny-moe", MOE),
         "sgd-tp2": (None, SGD + ["parallel.tp=2"])}  # one dp rank: each tp rank sees the whole batch


@pytest.mark.parametrize("name", list(CASES))
def test_single_rank_trainer_equals_plain_pytorch(dist_run, name):
    world = 2 if "parallel.tp=2" in CASES[name][1] else 1
    ours, plain = dist_run(world, trainer_and_plain_pytorch, *CASES[name])[0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, plain)):
        assert loss == pytest.approx(ref_loss, rel=1e-6), f"step {step}: loss {loss} vs plain PyTorch {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-6), f"step {step}: grad norm {norm} vs plain PyTorch {ref_norm}"
