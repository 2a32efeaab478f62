"""[train].optimizer: a torch.optim class on unsharded layouts. Its state (Adagrad's ``sum`` tensor, its
``step`` scalar) checkpoints as pieces and resumes bitwise under tp2, loads under dp2; resuming
with another optimizer, or a sharded zero with one, is one error line (exit 2 in the CLI). par-zero's
declared SGD and Lion resume bitwise under ZeRO-3.
The equivalence with plain torch.optim training is tests/test_trainer_matches_plain_pytorch.py ("sgd-tp2")."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

STEPS, SAVE_AT = 5, 2
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
          "model.layers=2"]
ADAGRAD = ["train.optimizer=adagrad", "train.optimizer_args={lr_decay=0.01}"]


def _trainer(*overrides):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    return Trainer(load_config(None, COMMON + list(overrides)))


def resume_job(root):
    from pretrain.checkpoint import latest_checkpoint
    from pretrain.checkpoint.full_model import read_full_tensors
    from pretrain.errors import UsageError

    out = {}
    t = _trainer(*ADAGRAD, "parallel.tp=2")
    losses = []
    for step in range(STEPS):
        losses.append(t.train_step(step).loss)
        if step + 1 == SAVE_AT:
            t.save_checkpoint(root, SAVE_AT)
    latest = latest_checkpoint(root)
    r = _trainer(*ADAGRAD, "parallel.tp=2")
    start = r.load_checkpoint(latest)
    out["bitwise"] = [r.train_step(step).loss for step in range(start, STEPS)] == losses[SAVE_AT:]
    d = _trainer(*ADAGRAD)  # dp2: each rank loads every piece of the tp2 save
    d.load_checkpoint(latest)
    d.save_checkpoint(f"{root}/again", SAVE_AT)
    saved, again = (read_full_tensors(latest_checkpoint(p), "optim/sum/") for p in (root, f"{root}/again"))
    out["dp2_sum_equal"] = len(saved) > 0 and sorted(saved) == sorted(again) and all(saved[k].equal(again[k])
                                                                                      for k in saved)
    out["dp2_step"] = d.model.dp.optimizer.scalar_state()
    try:
        _trainer("parallel.tp=2").load_checkpoint(latest)
    except UsageError as e:
        out["mismatch"] = str(e)
    out["state"] = json.loads((latest / "trainer_state.json").read_text())
    return out


def test_a_torch_optimizer_resumes_bitwise_loads_under_another_layout_and_must_match(dist_run, tmp_path):
    res = dist_run(2, resume_job, str(tmp_path / "ck"), timeout=600)[0]
    assert res["bitwise"] and res["dp2_sum_equal"], res
    assert res["dp2_step"] == {"step": float(SAVE_AT)}, res
    state = res["state"]
    assert (state["optimizer_name"], state["optimizer_kinds"], state["optimizer_scalars"]) == \
        ("adagrad", ["sum"], {"step": float(SAVE_AT)})
    assert res["mismatch"].endswith("holds the state of [train].optimizer='adagrad', the config says 'adamw': set it "
                                    "back, or start from its weights with [checkpoint].init_from"), res["mismatch"]


DECLARED = {"sgd": ["train.optimizer=sgd", "train.optimizer_args={momentum=0.9}"],
            "lion": ["train.optimizer=lion", "train.optimizer_args={betas=[0.9, 0.95]}", "train.lr=3e-4"]}


def declared_resume_job(root):
    """Per declared optimizer under ZeRO-3 (dp2): losses of the uninterrupted run and of a resume from step
    SAVE_AT, and what its checkpoint says it holds."""
    from pretrain.checkpoint import latest_checkpoint

    out = {}
    for name, sets in DECLARED.items():
        t = _trainer(*sets, "parallel.zero=optim_grads_params")
        losses = []
        for step in range(STEPS):
            losses.append(t.train_step(step).loss)
            if step + 1 == SAVE_AT:
                t.save_checkpoint(f"{root}/{name}", SAVE_AT)
        latest = latest_checkpoint(f"{root}/{name}")
        r = _trainer(*sets, "parallel.zero=optim_grads_params")
        start = r.load_checkpoint(latest)
        state = json.loads((latest / "trainer_state.json").read_text())
        out[name] = (losses[SAVE_AT:], [r.train_step(step).loss for step in range(start, STEPS)],
                     state["optimizer_name"], state["optimizer_kinds"])
    return out


@pytest.mark.timeout(300)  # alone, it starts the harness's ranks
def test_declared_sgd_and_lion_resume_bitwise_under_zero3(dist_run, tmp_path):
    """par-zero's SGD and Lion through the trainer's checkpoints: their state (``optim/<kind>/...``, the
    kinds their declarations name) saved under ZeRO-3 and resumed gives bitwise the uninterrupted losses."""
    res = dist_run(2, declared_resume_job, str(tmp_path / "ck"), timeout=600)[0]
    for name, kinds in (("sgd", ["momentum_buffer"]), ("lion", ["exp_avg"])):
        uninterrupted, resumed, saved_name, saved_kinds = res[name]
        assert resumed == uninterrupted and (saved_name, saved_kinds) == (name, kinds), res[name]


def test_a_sharded_zero_or_an_unknown_optimizer_is_one_line_and_exit_2(tmp_path):
    runner = CliRunner()
    for extra, line in [
        (["train.optimizer=adagrad", "parallel.zero=optim"],
         "error: [train].optimizer='adagrad' with [parallel].zero='optim': optimizer='Adagrad' needs strategy "
         "'no_shard' or 'torch_fsdp2'; strategy='optim' shards the optimizer, which par-zero's own optimizers do "
         "(AdamW, Muon, SGD, Lion)"),
        (["train.optimizer=sgdd"], "error: [train].optimizer='sgdd' is not one of adamw, asgd,"),
        (["train.optimizer=sgd", "train.optimizer_args={momentum=-1}"],
         "error: [train].optimizer='sgd' with [parallel].zero='no_shard': optimizer SGD with {'momentum': -1}: "
         "ValueError: Invalid momentum value: -1"),
        (["train.optimizer_args={momentum=0.9}"],
         "error: [train].optimizer='adamw' with [parallel].zero='no_shard': optimizer_args={'momentum': 0.9} is for "
         "a torch.optim class"),
        (["train.optimizer=lion", "train.optimizer_args={betas=[0.9, 1.5]}"],
         "error: [train].optimizer='lion' with [parallel].zero='no_shard': Lion betas=[0.9, 1.5] must be two numbers "
         "in [0, 1)"),
        (["train.optimizer=sgd", "train.optimizer_args={foreach=true}"],
         "error: [train].optimizer='sgd' with [parallel].zero='no_shard': SGD takes momentum, dampening, nesterov; "
         "not foreach"),
    ]:
        args = [a for kv in extra for a in ("--set", kv)]
        res = runner.invoke(app, ["train", "--nproc", "1", "--set", f"log.dir={tmp_path}", *args])
        assert res.exit_code == 2 and res.stderr.startswith(line) and res.stderr.count("\n") == 1, res.output


def fused_job(mode):
    """Three steps with [train].fused_adamw = ``mode``: (fused kernel calls, kernels' flag, losses)."""
    import par_zero.adamw as adamw

    calls, fused = [], adamw.fused_adamw_step_
    adamw.fused_adamw_step_ = lambda *a, **k: calls.append(1) or fused(*a, **k)
    try:
        t = _trainer(f"train.fused_adamw={mode}", "parallel.zero=optim_grads_params")
        losses = [t.train_step(s).loss for s in range(3)]
        return len(calls), t.kernels.fused_adamw, losses
    finally:
        adamw.fused_adamw_step_ = fused


def test_fused_adamw_on_runs_torchs_fused_kernel_on_the_cpu_to_rounding_of_auto(dist_run):
    """[train].fused_adamw = "on": par-zero's AdamW takes torch's fused kernel on the CPU (what the
    torchtitan race runs ours with, tools/bench/bench_trainer.py); the losses agree with the explicit
    update's (auto on the CPU) to rounding."""
    import math

    (auto_calls, auto_flag, auto), _ = dist_run(2, fused_job, "auto")
    (on_calls, on_flag, on), _ = dist_run(2, fused_job, "on")
    assert auto_calls == 0 and not auto_flag and on_calls > 0 and on_flag
    assert auto[0] == on[0] and all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(auto, on)), (auto, on)
