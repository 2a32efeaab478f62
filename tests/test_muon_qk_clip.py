"""[train].muon_qk_clip (MuonClip, Kimi K2) on one rank equals a plain re-implementation written here.

The plain side is test_muon_matches_torch's (plain PyTorch, torch.optim.Muon + AdamW), with its
attention wrapped to compute each head's logits explicitly (``q k^T / sqrt(D)``, causal mask, max over
the step's micro-batches) and, after each update, the weights clipped by hand: a head whose max passed
tau gets gamma = tau / max on W_q and W_k as sqrt(gamma) each with one key head per query head, and on
W_q alone as gamma with grouped key heads. tau is the median of the first step's head maxes, so heads
clip and heads do not; loss, grad norm and every param within 1e-6 over the steps.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch

from test_muon_matches_torch import TOLERANCE, param_errors, plain_run
from test_trainer_matches_plain_pytorch import COMMON

STEPS = 6
MUON = ["train.optimizer=muon", "train.muon_ns_dtype=fp32", "train.micro_batch=4", f"train.steps={STEPS}"]
CASES = {"gqa": ["model.kv_heads=4"], "mha": ["model.kv_heads=8"]}  # 8 query heads


class HandQKClip:
    """Patched into plain PyTorch: each attention's explicit per-head max, and the clip by hand."""

    def __init__(self, tau: float):
        import plain_llama

        self.tau, self.plain, self.current, self.maxes, self.log = tau, plain_llama, None, {}, []

    def attention(self, q, k, v, scale=None):  # q, k [S, B, heads, D] after RoPE
        qh, kh = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3).repeat_interleave(q.shape[2] // k.shape[2], dim=1)
        logits = qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5  # [B, H, S, S]
        causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
        top = logits.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3)).detach()
        m = self.current
        self.maxes[m] = top if m not in self.maxes else torch.maximum(self.maxes[m], top)
        return self.real_attention(q, k, v, scale)

    @torch.no_grad()
    def after_step(self, model) -> None:
        for layer in model.model.layers:
            a = layer.self_attn
            s = self.maxes.pop(a)
            self.log.append(s)
            gamma = torch.where(s > self.tau, self.tau / s, torch.ones_like(s))
            if a.q_proj.weight.shape == a.k_proj.weight.shape:  # a key head per query head
                a.q_proj.weight.mul_(gamma.sqrt().repeat_interleave(a.d)[:, None])
                a.k_proj.weight.mul_(gamma.sqrt().repeat_interleave(a.d)[:, None])
            else:  # grouped key heads: the query head takes it all
                a.q_proj.weight.mul_(gamma.repeat_interleave(a.d)[:, None])

    def build(self, *args, **kwargs):
        model = self.real_build(*args, **kwargs)
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(lambda m, _: setattr(self, "current", m))
        return model

    @contextlib.contextmanager
    def patched(self):
        self.real_attention, self.real_build = self.plain.attention, self.plain.build_plain
        with mock.patch.object(self.plain, "attention", self.attention), \
                mock.patch.object(self.plain, "build_plain", self.build):
            yield self


def qk_clip_job(overrides):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config(None, COMMON + MUON + overrides)
    first = HandQKClip(math.inf)
    with first.patched():
        plain_run(cfg, Trainer(cfg).sampler, 1, after_step=first.after_step)
    tau = torch.cat(first.log).median().item()  # the first step's head maxes: half of them clip
    cfg = load_config(None, COMMON + MUON + overrides + [f"train.muon_qk_clip={tau}"])
    trainer = Trainer(cfg)
    ours = [(r.loss, r.grad_norm) for r in (trainer.train_step(s) for s in range(STEPS))]
    params = {n: t.detach().clone() for n, t in trainer.model.full_named_tensors().items()}
    hand = HandQKClip(tau)
    with hand.patched():
        plain, plain_params = plain_run(cfg, trainer.sampler, STEPS, after_step=hand.after_step)
    clipped = torch.stack(hand.log) > tau  # [steps x layers, heads]
    return ours, plain, param_errors(params, plain_params), clipped.sum().item(), clipped.numel()


@pytest.mark.parametrize("name", list(CASES))
def test_qk_clip_equals_a_plain_reimplementation(dist_run, name):
    ours, plain, errors, clipped, total = dist_run(1, qk_clip_job, CASES[name])[0]
    loss = max(abs(a / b - 1) for (a, _), (b, _) in zip(ours, plain))
    norm = max(abs(a / b - 1) for (_, a), (_, b) in zip(ours, plain))
    where = max(errors, key=errors.get)
    print(f"{name}: {clipped}/{total} head-steps clipped; max rel error: loss {loss:.1e} grad norm {norm:.1e} "
          f"param {errors[where]:.1e} ({where})")
    assert 0 < clipped < total
    assert loss <= TOLERANCE and norm <= TOLERANCE and errors[where] <= TOLERANCE, (loss, norm, where, errors[where])
