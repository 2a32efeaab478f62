"""The LR schedules of ``[train]`` against outside oracles: megatron-core's ``OptimizerParamScheduler``
(a test-only dependency) for every decay style, WSD's decay shapes and sample-based schedules, and
``torch.optim.lr_scheduler`` for the linear warm-up and the cosine / linear decays.

par's step ``s`` (0-based) runs at Megatron's ``num_steps = s`` once warm, ``s + 1`` during the warm-up
(Megatron's first step runs at LR 0); in samples, ``s x global_batch``.
"""

from __future__ import annotations


import pytest
import torch

from pretrain.config import load_config
from pretrain.training.schedule_lr import lr_at, lr_for, schedule_bounds

sched = pytest.importorskip("megatron.core.optimizer_param_scheduler")


class _Groups:  # what OptimizerParamScheduler touches of a MegatronOptimizer
    def __init__(self):
        self.param_groups = [{}]


def megatron(t, steps: int) -> list[float]:
    """Megatron's LR for par's steps 0..steps-1 with the bounds par resolved (in its units)."""
    unit, warmup, decay, wsd = schedule_bounds(t)
    style = {"wsd": "WSD"}.get(t.lr_decay_style, t.lr_decay_style)
    s = sched.OptimizerParamScheduler(_Groups(), init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=warmup,
                                      lr_decay_steps=decay, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                      wd_incr_steps=1, wd_incr_style="constant", wsd_decay_steps=wsd or None,
                                      lr_wsd_decay_style=t.lr_wsd_decay_style)
    out = []
    for step in range(steps):
        pos = step * unit
        s.num_steps = pos + unit if pos + unit <= warmup else pos
        out.append(s.get_lr({}))
    return out


def train(*sets: str):
    return load_config(None, ["train.lr=1e-3", "train.min_lr=1e-4", *sets]).train


CASES = {
    "cosine": ("train.steps=40", "train.warmup_steps=5"),
    "cosine, decay before the end": ("train.steps=40", "train.warmup_steps=5", "train.lr_decay_steps=30"),
    "linear": ("train.steps=40", "train.warmup_steps=5", "train.lr_decay_style='linear'"),
    "constant": ("train.steps=20", "train.warmup_steps=3", "train.lr_decay_style='constant'"),
    "inverse-square-root": ("train.steps=40", "train.warmup_steps=4", "train.lr_decay_style='inverse-square-root'"),
    "inverse-square-root, no warm-up": ("train.steps=20", "train.warmup_steps=0",
                                        "train.lr_decay_style='inverse-square-root'"),
    **{f"wsd {shape}": ("train.steps=40", "train.warmup_steps=5", "train.lr_decay_style='wsd'",
                        "train.lr_wsd_decay_steps=10", f"train.lr_wsd_decay_style='{shape}'")
       for shape in ("linear", "cosine", "exponential", "minus_sqrt")},
    "wsd, torchtitan's decay_ratio": ("train.steps=40", "train.warmup_steps=2", "train.lr_decay_style='wsd'",
                                      "train.lr_wsd_decay_ratio=0.2"),
    "samples": ("train.global_batch=8", "train.train_samples=250", "train.lr_warmup_samples=20",
                "train.lr_decay_style='linear'"),
    "samples, wsd": ("train.global_batch=8", "train.train_samples=320", "train.lr_warmup_samples=24",
                     "train.lr_decay_samples=300", "train.lr_decay_style='wsd'", "train.lr_wsd_decay_samples=100",
                     "train.lr_wsd_decay_style='cosine'"),
}


@pytest.mark.parametrize("case", CASES)
def test_schedule_matches_megatron(case):
    t = train(*CASES[case])
    ours = [lr_for(s, t) for s in range(t.steps + 3)]  # past the end: min_lr (constant: lr)
    assert ours == pytest.approx(megatron(t, t.steps + 3), rel=1e-12, abs=1e-18)
    assert max(ours) <= t.lr * (1 + 1e-12) and min(ours) >= 0


def test_sample_keys_set_steps_and_bounds():
    t = train(*CASES["samples"])
    assert t.steps == 250 // 8 and schedule_bounds(t) == (8, 20, 250, 0)


def test_cosine_default_is_the_arithmetic_par_always_had():
    t = train("train.steps=30", "train.warmup_steps=4")
    assert [lr_for(s, t) for s in range(30)] == [lr_at(s, lr=t.lr, min_lr=t.min_lr, warmup_steps=4, steps=30)
                                                   for s in range(30)]


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_warmup_and_decay_match_torch_lr_scheduler(style):
    """torch's LinearLR (warm-up) then CosineAnnealingLR / LinearLR (decay to min_lr), stepped per step."""
    t = train("train.steps=25", "train.warmup_steps=5", "train.min_lr=0", f"train.lr_decay_style='{style}'")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / 5, end_factor=1.0, total_iters=4)
    decay = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=0.0) if style == "cosine" else
             torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=20))
    # warm-up steps 0..4 (the peak at step 4 = warmup_steps - 1 ... and again at 5, the decay's start)
    both = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[5])
    theirs = []
    for _ in range(25):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        both.step()
    ours = [lr_for(s, t) for s in range(25)]
    assert ours[:5] == pytest.approx(theirs[:5], rel=1e-12)
    assert ours[5:] == pytest.approx(theirs[5:], rel=1e-9, abs=1e-15)


def _train_job(overrides):
    from pretrain.training.train_loop import Trainer

    t = Trainer(load_config(None, overrides))
    return {"eps": t.model.dp.cfg.eps, "lrs": [t.train_step(s).lr for s in range(4)]}


@pytest.mark.timeout(300)  # alone, it starts the harness's ranks
def test_new_keys_train_eps_reaches_the_optimizer_and_steps_follow_the_schedule(dist_run):
    sets = ["model.layers=2", "train.steps=4", "train.warmup_steps=1", "train.eval_every=0", "parallel.tp=1",
            "train.nproc=1", "train.adam_eps=1e-6", "train.lr_decay_style='wsd'", "train.lr_wsd_decay_steps=2",
            "train.lr_wsd_decay_style='minus_sqrt'"]
    res = dist_run(1, _train_job, sets)[0]
    t = load_config(None, sets).train
    assert res["eps"] == 1e-6
    assert res["lrs"] == [lr_for(s, t) for s in range(4)] == pytest.approx(megatron(t, 4), rel=1e-12)
