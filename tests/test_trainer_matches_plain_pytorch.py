"""The trainer's single-rank run equals plain PyTorch training of the reference model.

The layout tests compare every layout with the trainer's own single-rank run; this one anchors
that run to an independent computation: `LlamaReference` (nn.Linear, SDPA, nn.RMSNorm), the same
batches, `torch.optim.AdamW` with two param groups (no weight decay on norms and the embedding),
`torch.nn.utils.clip_grad_norm_` and the same LR schedule.
"""

import pytest
import torch
import torch.nn.functional as F

STEPS = 6
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=2", "train.eval_every=0", "log.progress=false",
          "model.layers=2", "train.grad_clip=0.5"]


def trainer_and_plain_pytorch(overrides):
    from pretrain.config import load_config
    from pretrain.model.reference import build_reference
    from pretrain.schedule_lr import lr_at
    from pretrain.train_loop import Trainer

    cfg = load_config(None, COMMON + list(overrides))
    trainer = Trainer(cfg)
    ours = [trainer.train_step(step) for step in range(STEPS)]

    t = cfg.train
    model = build_reference(cfg.model, t.seed)
    named = dict(model.named_parameters())  # tied weights once
    params = list(named.values())
    # two groups, as nanoGPT and Megatron: no weight decay on norms, biases and the embedding
    plain_decay = [p for n, p in named.items() if p.dim() >= 2 and n != "model.embed_tokens.weight"]
    groups = [{"params": plain_decay}, {"params": [p for p in params if all(p is not q for q in plain_decay)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay)
    plain = []
    for step in range(STEPS):
        batch = trainer.sampler.train_batch(step)
        losses = []
        for m in range(batch.tokens.shape[0]):
            logits, _ = model(batch.inputs[m].t())
            loss = F.cross_entropy(logits.flatten(0, 1), batch.labels[m].t().flatten())
            (loss / batch.tokens.shape[0]).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, steps=t.steps)
        opt.step()
        opt.zero_grad()
        plain.append((sum(losses) / len(losses), float(norm)))
    return [(r.loss, r.grad_norm) for r in ours], plain


@pytest.mark.parametrize("tied", [False, True])
def test_single_rank_trainer_equals_plain_pytorch(dist_run, tied):
    ours, plain = dist_run(1, trainer_and_plain_pytorch, [f"model.tie_embeddings={str(tied).lower()}"])[0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, plain)):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}: loss {loss} vs plain PyTorch {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"step {step}: grad norm {norm} vs plain PyTorch {ref_norm}"
