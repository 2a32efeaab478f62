"""The trainer equals plain PyTorch training of the same model, on one rank and under a layout.

The layout tests compare every layout with the trainer's own single-rank run; this one anchors
that run to an independent computation. Shared with the trainer: only the batches (its sampler)
and the initial weights (``init_full_state``, loaded by HF name into tests/plain_llama.py's model,
so a wrong tensor fails the load rather than hiding). Everything else is written here or is torch's:
the model (plain_llama: RoPE, attention, MoE through par-moe's loop-over-experts reference with
its balancing losses added to the loss), gradient accumulation (a mean of micro-batch means),
`torch.optim.AdamW` with two param groups (no weight decay on norms and the embedding; or the
torch.optim class `[train].optimizer` names: SGD with momentum under tp2),
`torch.nn.utils.clip_grad_norm_` (binding at every step: asserted), the LR schedule from
`torch.optim.lr_scheduler` (LinearLR warm-up, then CosineAnnealingLR to min_lr, as the README
documents), and for MoE the aux-free bias update written out (``bias += rate * sign(mean load - load)``).
A bug in the trainer's model, accumulation, optimizer, clipping or schedule is on one side only.
fp32, 6 steps (2 of warm-up, 4 of decay): loss within 1.9e-7 and grad norm within 5.0e-7
(relative) measured over the six cases (`pytest -s` prints each), so 1e-6; the seventh
(qwen3-moe: qk_norm, head_dim, llama3 RoPE scaling, norm_topk_prob, expert groups) measured
1.0e-7 and 8.3e-7, and on a Sapphire Rapids CPU 2.1e-7 and 1.1e-6, where plain PyTorch's own fp32
run lies 5.4e-7 from its fp64 run: a step past 1e-6 passes within 4x that noise.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from layout_runs import assert_close_steps, fp64_noise
from moe_stepwise import name_moe_layers, recorded_routing, steps_before_flip

STEPS = 6
# A step off by more than 1e-6 passes only within 4x plain PyTorch's own fp32 rounding there (its
# distance from the same run in fp64; layout_runs.assert_close_steps). Measured on a Sapphire Rapids
# CPU: qwen3-moe's grad norm at step 1, 1.1e-6.
TOLERANCE = 1e-6
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=2", "train.eval_every=0", "log.progress=false",
          "model.layers=2", "train.grad_clip=0.5"]


# every balancing term and the bias update on, each large enough to show in the grad norm
MOE = ["model.layers=3", "model.aux_loss_coeff=0.01", "model.seq_aux_loss_coeff=1.0", "model.z_loss_coeff=0.001",
       "model.bias_update_rate=0.001"]


def count_routed(moe, load, margins: list):
    """Wrap ``moe.route`` to add each forward's routed pairs per expert to ``load`` and its smallest
    top-k margin (of the selection scores) to ``margins``."""
    route = moe.route

    def counting(tokens):
        out = route(tokens)
        load.add_(torch.bincount(out[2].reshape(-1), minlength=load.numel()))
        select = (out[1].detach() + moe.router.expert_bias).sort(dim=-1, descending=True).values
        margins.append(float((select[:, moe.config.top_k - 1] - select[:, moe.config.top_k]).min()))
        return out

    moe.route = counting


def mean_of_microbatches(model, sampler, step: int) -> tuple[torch.Tensor, float]:
    """(what to backward, the logged loss) of one step: the whole global batch cut into micro-batches
    of ``[train].micro_batch`` sequences, the mean over them of each one's mean token loss, plus the
    MoE balancing losses of each (a data-parallel layout holds some of these micro-batches per rank)."""
    tokens = sampler.global_train_batch(step).tokens
    tokens = tokens.view(-1, sampler.micro_batch, tokens.shape[-1])
    n, total, logged = tokens.shape[0], 0.0, 0.0
    for m in range(n):
        logits, aux = model(tokens[m, :, :-1].t())
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[m, :, 1:].t().flatten())
        total = total + (loss + aux) / n
        logged += loss.item() / n
    return total, logged


def lr_schedule(opt, t):
    """torch's: linear warm-up from lr / warmup_steps to lr, then a cosine to min_lr at ``steps``."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    assert t.warmup_steps > 0, "a schedule with warm-up"
    warmup = LinearLR(opt, start_factor=1 / t.warmup_steps, total_iters=max(1, t.warmup_steps - 1))
    decay = CosineAnnealingLR(opt, T_max=max(1, t.steps - t.warmup_steps), eta_min=t.min_lr)  # a run of warm-up only: 1
    return SequentialLR(opt, [warmup, decay], milestones=[t.warmup_steps])


def trainer_and_plain_pytorch(config, overrides, plain_loss=mean_of_microbatches, steps=STEPS, plain64=False):
    """[(loss, grad norm)] per step of the trainer and of plain PyTorch; ``plain64``: and, where a step
    differs by more than TOLERANCE, plain PyTorch again in fp64 (None where none does)."""
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config(config, COMMON + list(overrides))
    trainer = Trainer(cfg)
    name_moe_layers(trainer)
    ours, our_routing = [], []
    for step in range(steps):
        with recorded_routing() as log:
            r = trainer.train_step(step)
        ours.append((r.loss, r.grad_norm))
        our_routing.append(dict(log))
    routing = []
    plain = plain_pytorch(cfg, trainer.sampler, plain_loss, steps, routing=routing)
    if not plain64:
        return ours, plain
    beyond = any(abs(a / b - 1) > TOLERANCE for step in zip(ours, plain) for a, b in zip(*step))
    plain64 = plain_pytorch(cfg, trainer.sampler, plain_loss, steps, torch.float64) if beyond else None
    return ours, plain, plain64, our_routing, routing


def plain_pytorch(cfg, sampler, plain_loss=mean_of_microbatches, steps=STEPS, dtype=torch.float32, routing=None):
    """[(logged loss, pre-clip grad norm)] per step of plain PyTorch training in ``dtype`` (see the module doc).
    ``routing`` gets, per step, ({MoE layer name: routed pairs per expert}, the smallest top-k margin)."""
    from plain_llama import build_plain

    t = cfg.train
    model = build_plain(cfg.model, t.seed).to(dtype)
    named = dict(model.named_parameters())  # tied weights once
    params = list(named.values())
    # two groups, as nanoGPT and Megatron: no weight decay on norms, biases and the embedding
    plain_decay = [p for n, p in named.items() if p.dim() >= 2 and n != "model.embed_tokens.weight"]
    groups = [{"params": plain_decay}, {"params": [p for p in params if all(p is not q for q in plain_decay)], "weight_decay": 0.0}]
    if t.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay)
    else:  # [train].optimizer names a torch.optim class: that class, the same two groups
        opt = getattr(torch.optim, t.optimizer_class)(groups, lr=t.lr, weight_decay=t.weight_decay, **t.optimizer_args)
    schedule = lr_schedule(opt, t)
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "route")]
    loads = [torch.zeros(m.config.num_experts, dtype=torch.int64) for m in moes]
    margins = []
    for moe, load in zip(moes, loads):
        count_routed(moe, load, margins)
    names = [f"model.layers.{i}.mlp.router.weight" for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "route")]
    plain = []
    for step in range(steps):
        loss, logged = plain_loss(model, sampler, step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad()
        schedule.step()
        if routing is not None and moes:
            routing.append(({n: load.tolist() for n, load in zip(names, loads)}, min(margins)))
            margins.clear()
        with torch.no_grad():
            for moe, load in zip(moes, loads):
                moe.router.expert_bias += cfg.model.bias_update_rate * torch.sign(load.double().mean() - load)
                load.zero_()
        plain.append((logged, float(norm)))
    return plain


# SGD: lr large enough that the weight-decay mask moves the loss well beyond the tolerance
SGD = ["train.optimizer=sgd", "train.optimizer_args={momentum=0.9, nesterov=true}", "train.lr=0.3", "train.min_lr=0.03"]
TWO_MICRO_BATCHES = ["train.micro_batch=4"]
# issue 34's model options on one rank: Qwen3's qk_norm and head_dim, Llama 3.1's RoPE scaling (the plain
# side takes its frequencies from transformers), softmax scores renormalized over the chosen experts,
# two expert groups scored by their top 2, and a dense layer between MoE ones (mlp_only_layers)
QWEN3 = ["model.qk_norm=true", "model.kv_channels=16", "model.norm_topk_prob=true", "model.n_groups=2",
         "model.topk_groups=1", "model.layers=4", "model.mlp_only_layers=[2]",
         'model.rope_scaling={rope_type = "llama3", factor = 4.0, low_freq_factor = 1.0, high_freq_factor = 4.0, '
         'original_max_position_embeddings = 16}']  # of the global batch of 8: accumulation over 2 on one rank
CASES = {  # name: (config, overrides, ranks)
    "dense": (None, TWO_MICRO_BATCHES, 1),
    "tied": (None, ["model.tie_embeddings=true"], 1),
    "moe": ("tiny-moe", MOE + TWO_MICRO_BATCHES, 1),
    "dense-dp2": (None, ["train.micro_batch=2"], 2),  # 2 micro-batches of 2 per dp rank, then the dp reduction
    # one dp rank: each tp rank sees the whole batch; MoE routes each rank's S/tp tokens (SP)
    "moe-tp2": ("tiny-moe", MOE + TWO_MICRO_BATCHES + ["parallel.tp=2"], 2),
    "sgd-tp2": (None, SGD + ["parallel.tp=2"], 2),
    "qwen3-moe": ("tiny-moe", MOE + QWEN3, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_equals_plain_pytorch(dist_run, name):
    config, overrides, world = CASES[name]
    ours, plain, plain64, our_routing, routing = dist_run(world, trainer_and_plain_pytorch, config, overrides,
                                                          plain64=True)[0]
    assert all(norm > 0.5 for _, norm in plain), "grad_clip=0.5 must bind at every step"
    print(f"{name}: max rel error loss {max(abs(a / b - 1) for (a, _), (b, _) in zip(ours, plain)):.1e} "
          f"grad norm {max(abs(a / b - 1) for (_, a), (_, b) in zip(ours, plain)):.1e}")  # the evidence for 1e-6
    steps = STEPS  # MoE: the steps before a near-tie routing flip (after it the runs hold other weights)
    if routing:
        steps = steps_before_flip(name, ours, our_routing, plain, [r for r, _ in routing], [m for _, m in routing])
    columns = lambda run: tuple(zip(*run[:steps]))  # noqa: E731  [(loss, norm)] per step -> (losses, norms)
    assert_close_steps(columns(ours), columns(plain), TOLERANCE, name, steps=steps,
                       noise=lambda: fp64_noise(columns(plain), columns(plain64)))


def test_lr_schedule_is_torchs_warmup_then_cosine():
    """Every step's LR of `pretrain.training.schedule_lr.lr_at` against torch's schedulers (above), and past
    ``steps`` it stays at min_lr."""
    from types import SimpleNamespace

    from pretrain.training.schedule_lr import lr_at

    t = SimpleNamespace(lr=3e-3, min_lr=3e-4, warmup_steps=5, steps=30)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.lr)
    schedule, want = lr_schedule(opt, t), []
    with warnings.catch_warnings():  # no opt.step() to read a schedule (its first call imports torch._dynamo: ~5 s)
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before", UserWarning)
        for _ in range(t.steps):
            want.append(opt.param_groups[0]["lr"])
            schedule.step()
    got = [lr_at(s, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, steps=t.steps) for s in range(t.steps)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert lr_at(t.steps + 7, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, steps=t.steps) == t.min_lr
