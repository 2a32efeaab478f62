"""[train].optimizer = "muon" on one rank equals torch.optim.Muon + torch.optim.AdamW on plain PyTorch.

The plain side is test_trainer_matches_plain_pytorch's (tests/plain_llama.py's model, its micro-batch
mean, clip_grad_norm_ and torch's LR schedulers), with the optimizers written here from torch's
classes and nothing of par's: torch.optim.Muon on the hidden matrices (each routed expert of an
``[E, F, H]`` tensor a matrix of its own: a leaf sharing that expert's storage), torch.optim.AdamW on
the embedding, the head, norms and the router (weight decay on the 2-D ones but the embedding, as the
trainer's mask). 20 steps; loss, grad norm and every parameter within 1e-6 (relative; a parameter:
its largest entry error over its largest entry).

Newton-Schulz runs in ``[train].muon_ns_dtype``: bf16 (torch's, the default) and fp32. torch.optim.Muon
has bf16 only, so the fp32 case runs torch's own ``torch.optim._muon`` code with its one
``torch.bfloat16`` read as fp32 (a proxy of the ``torch`` module it reads the name from). In bf16 a
gradient that differs in its last fp32 bit can round to another bf16 value, so there the trainer and
plain PyTorch, which sum the gradients in different orders, agree within bf16's rounding only.
"""

from __future__ import annotations

import types

import pytest
import torch
from layout_runs import NOISE_MARGIN
from test_trainer_matches_plain_pytorch import COMMON, MOE, count_routed, lr_schedule, mean_of_microbatches

STEPS = 20
TOLERANCE = 1e-6
MUON_ADAMW = ("embed_tokens", "lm_head", "router")  # and every 1-D param: AdamW


class _TorchWithBfloat16As(types.ModuleType):
    """The ``torch`` module, but ``torch.bfloat16`` is ``dtype`` (for torch.optim._muon's Newton-Schulz)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__("torch")
        self.ns_dtype = dtype

    def __getattr__(self, name):
        return self.ns_dtype if name == "bfloat16" else getattr(torch, name)


def plain_muon(cfg, sampler, steps: int, dtype=torch.float32, after_step=None):
    """[(loss, pre-clip grad norm)] per step and the final {HF name: param} of plain PyTorch with torch's Muon;
    ``after_step(model)`` runs after each update (test_muon_qk_clip's hand QK-clip)."""
    from plain_llama import build_plain

    t = cfg.train
    model = build_plain(cfg.model, t.seed).to(dtype)
    named = dict(model.named_parameters())
    params = list(named.values())
    matrices, adam_decay, adam_keep, experts = [], [], [], []
    for name, p in named.items():
        if p.dim() == 1 or any(part in name for part in MUON_ADAMW):
            (adam_decay if p.dim() >= 2 and "embed_tokens" not in name else adam_keep).append(p)
        elif p.dim() == 2:
            matrices.append(p)
        else:  # routed experts: one matrix each, a leaf viewing the expert's storage
            views = [torch.nn.Parameter(p.data[e]) for e in range(p.shape[0])]
            experts.append((p, views))
            matrices += views
    muon = torch.optim.Muon(matrices, lr=t.lr, weight_decay=t.weight_decay, momentum=t.muon_momentum,
                            nesterov=t.muon_nesterov, ns_steps=t.muon_ns_steps, adjust_lr_fn=t.muon_adjust_lr_fn)
    adamw = torch.optim.AdamW([{"params": adam_decay}, {"params": adam_keep, "weight_decay": 0.0}], lr=t.lr,
                              betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay)
    schedules = [lr_schedule(muon, t), lr_schedule(adamw, t)]
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "route")]
    loads = [torch.zeros(m.config.num_experts, dtype=torch.int64) for m in moes]
    for moe, load in zip(moes, loads):
        count_routed(moe, load, [])
    out = []
    for step in range(steps):
        loss, logged = mean_of_microbatches(model, sampler, step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for p, views in experts:
            for e, v in enumerate(views):
                v.grad = p.grad[e]
        muon.step()
        adamw.step()
        if after_step is not None:
            after_step(model)
        model.zero_grad(set_to_none=True)
        for o in (muon, adamw):
            o.zero_grad()
        for s in schedules:
            s.step()
        with torch.no_grad():  # the aux-free balancing bias, as test_trainer_matches_plain_pytorch
            for moe, load in zip(moes, loads):
                moe.router.expert_bias += cfg.model.bias_update_rate * torch.sign(load.double().mean() - load)
                load.zero_()
        out.append((logged, float(norm)))
    return out, {n: p.detach().clone() for n, p in named.items()}


def plain_run(cfg, sampler, steps: int, dtype=torch.float32, after_step=None):
    """:func:`plain_muon` with torch's Newton-Schulz in ``dtype`` when ``[train].muon_ns_dtype`` is fp32."""
    if cfg.train.muon_ns_dtype != "fp32":
        return plain_muon(cfg, sampler, steps, dtype, after_step)
    muon_module = torch.optim._muon
    real, muon_module.torch = muon_module.torch, _TorchWithBfloat16As(dtype)
    try:
        return plain_muon(cfg, sampler, steps, dtype, after_step)
    finally:
        muon_module.torch = real


def trainer_and_torch_muon(config, overrides, steps=STEPS):
    """Per step (loss, grad norm) of the trainer and plain PyTorch, each one's final params, and the
    relative distance of each of plain PyTorch's fp32 params from its fp64 run (only when a param
    differs from the trainer's by more than TOLERANCE: the oracle's own rounding noise)."""
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config(config, COMMON + [f"train.steps={steps}", "train.optimizer=muon"] + list(overrides))
    trainer = Trainer(cfg)
    ours = [(r.loss, r.grad_norm) for r in (trainer.train_step(s) for s in range(steps))]
    params = {n: t.detach().clone() for n, t in trainer.model.full_named_tensors().items()}
    plain, plain_params = plain_run(cfg, trainer.sampler, steps)
    noise = None
    if max(param_errors(params, plain_params).values()) > TOLERANCE:
        noise = param_errors(plain_params, plain_run(cfg, trainer.sampler, steps, torch.float64)[1])
    return ours, plain, param_errors(params, plain_params), noise


def param_errors(params: dict, reference: dict) -> dict[str, float]:
    """{name: ||ours - reference|| / ||reference||} over the reference's params (the trainer's
    embedding and head carry vocabulary padding rows past the plain model's: left out)."""
    out = {}
    for name, want in reference.items():
        got = params[name][:want.shape[0]].double()
        out[name] = ((got - want.double()).norm() / want.double().norm()).item()
    return out


CASES = {  # name: (config, overrides, tolerance)
    "dense-fp32": (None, ["train.micro_batch=4", "train.muon_ns_dtype=fp32"], TOLERANCE),
    "moe-fp32": ("tiny-moe", MOE + ["train.micro_batch=4", "train.muon_ns_dtype=fp32"], TOLERANCE),
    "dense-bf16": (None, ["train.micro_batch=4", "train.muon_adjust_lr_fn=match_rms_adamw"], 1e-3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_muon_trainer_equals_torch_muon(dist_run, name):
    """Loss and grad norm at every step, and every param after the last, within the tolerance; a param
    past it only within NOISE_MARGIN x plain PyTorch's own fp32 distance from its fp64 run there."""
    config, overrides, tolerance = CASES[name]
    ours, plain, errors, noise = dist_run(1, trainer_and_torch_muon, config, overrides)[0]
    loss = max(abs(a / b - 1) for (a, _), (b, _) in zip(ours, plain))
    norm = max(abs(a / b - 1) for (_, a), (_, b) in zip(ours, plain))
    where = max(errors, key=errors.get)
    print(f"{name}: max rel error over {STEPS} steps: loss {loss:.1e} grad norm {norm:.1e} param {errors[where]:.1e} "
          f"({where}{f'; its fp32 noise {noise[where]:.1e}' if noise else ''})")
    assert all(n > 0.5 for _, n in plain), "grad_clip=0.5 binds at every step"
    assert loss <= tolerance and norm <= tolerance, (loss, norm)
    for name_, error in errors.items():
        assert error <= tolerance or (noise and error <= NOISE_MARGIN * noise[name_]), (name_, error, noise and noise[name_])
