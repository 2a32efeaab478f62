"""Training, not just logits, against an oracle outside the project: a tiny random Hugging Face
`LlamaForCausalLM` (built offline), imported into the trainer, trains like transformers' own model
with `torch.optim.AdamW` and `torch.nn.utils.clip_grad_norm_` on the same batches.

Everything of the reference is transformers' or torch's: its attention, RoPE (plain positions,
while the cp2 run sees the zigzag shard's positions), RMSNorm, loss, optimizer and clipping.
5 steps at a constant LR; losses and pre-clip grad norms agree to 1e-6 relative (measured: loss
<= 1.9e-7, grad norm <= 5.1e-7 over 1 rank, tp2, pp2, cp2; 1 rank and pp2 now run in
test_hf_families.py, with a schedule and accumulation).
"""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

STEPS, LR = 5, 3e-3
# Constant LR (min_lr = lr, no warmup) so the reference needs no schedule; clipping active.
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=0", f"train.lr={LR}", f"train.min_lr={LR}",
          "train.grad_clip=0.5", "train.seq_len=32", "train.global_batch=4", "train.eval_every=0",
          "log.progress=false"]
TOLERANCE = 1e-6


def tiny_llama():
    """The same random model on every process (seeded), with non-trivial norm weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      rope_theta=5000.0, tie_word_embeddings=False, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def train_imported(overrides):
    """The trainer, started from the imported HF weights: (losses, grad norms) and the global batches."""
    from pretrain.checkpoint.hf import model_config_from_hf
    from pretrain.config import Config, apply_overrides, config_from_dict
    from pretrain.training.train_loop import Trainer

    hf = tiny_llama()
    imported = Config(model=model_config_from_hf(hf.config.to_dict())).to_dict()["model"]
    cfg = config_from_dict(apply_overrides({"model": imported}, COMMON + list(overrides)))
    trainer = Trainer(cfg, full_state=hf.state_dict())
    results = [trainer.train_step(step) for step in range(STEPS)]
    batches = [trainer.sampler.train_batch(step).tokens.flatten(0, 1) for step in range(STEPS)]
    return [r.loss for r in results], [r.grad_norm for r in results], batches


def train_transformers(batches, position_ids=None):
    """transformers' model, torch AdamW and clip_grad_norm_ on the same global batches;
    ``position_ids(inputs)``: the RoPE positions to give it (default: 0..S-1 in every sequence)."""
    from pretrain.config import load_config

    t = load_config(None, COMMON).train
    model = tiny_llama()
    # no weight decay on norms and the embedding (the trainer's mask, as nanoGPT and Megatron)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "model.embed_tokens.weight"]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=LR, betas=(t.beta1, t.beta2),
                            eps=1e-8, weight_decay=t.weight_decay)
    losses, norms = [], []
    for tokens in batches:
        inputs = tokens[:, :-1]
        # with position_ids, an all-ones mask keeps transformers from inferring document masks from them
        extra = {} if position_ids is None else {"position_ids": position_ids(inputs), "attention_mask": torch.ones_like(inputs)}
        logits = model(inputs, **extra).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


# 1 rank and pp2 (with a warm-up + cosine schedule and accumulation): tests/test_hf_families.py
LAYOUTS = {"tp2": ["parallel.tp=2"], "cp2": ["parallel.cp=2"]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_from_imported_llama_trains_like_transformers(dist_run, name):
    runs = dist_run(2, train_imported, LAYOUTS[name])
    ref_losses, ref_norms = train_transformers(runs[0][2])
    for losses, norms, _ in runs:
        for step in range(STEPS):
            assert abs(losses[step] - ref_losses[step]) <= TOLERANCE * ref_losses[step], \
                f"{name} step {step}: loss {losses[step]} vs transformers {ref_losses[step]}"
            assert abs(norms[step] - ref_norms[step]) <= TOLERANCE * ref_norms[step], \
                f"{name} step {step}: grad norm {norms[step]} vs transformers {ref_norms[step]}"
    assert ref_norms[0] > 0.5  # clipping really acts
