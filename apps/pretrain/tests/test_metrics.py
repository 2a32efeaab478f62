"""Metrics: log.jsonl records, MFU from model FLOPs and a known peak, plain and live progress, no TensorBoard."""

import builtins
import io
import json

import pytest
import torch
from rich.console import Console

from pretrain.observe.metrics import MetricsLogger, lookup_peak_tflops, mfu, peak_flops


def test_peak_lookup_and_given_value():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert lookup_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 156.0
    assert lookup_peak_tflops("Some Future Chip") is None
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), given_tflops=2.5) == 2.5e12
    assert mfu(4e12, 2.0, 1e12, 4) == pytest.approx(0.5) and mfu(1, 1, None, 1) is None


def test_jsonl_has_one_object_per_step_and_plain_lines_off_terminal(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with MetricsLogger(tmp_path / "run", total_steps=4, flops_per_step=1e12, peak_flops_per_device=1e12, devices=2,
                       tokens_per_step=512, every=2, console=console) as log:
        for step in range(1, 5):
            log.log(step, 5.0 - step, step_time=0.25, lr=1e-3, grad_norm=1.5)
        log.log_eval(4, 0.5)
        log.log_eval(4, 0.5, held_out="the last 5 % of each source's tokens")
    lines = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 4, 4] and [r.get("loss") for r in lines[:4]] == [4.0, 3.0, 2.0, 1.0]
    assert lines[0]["tokens_per_s"] == 2048 and lines[0]["mfu"] == pytest.approx(2.0) and lines[0]["memory_gb"] > 0
    assert lines[-1]["eval_loss"] == 0.5 and "loss" not in lines[-1] and lines[-1].keys() == lines[-2].keys()
    printed = out.getvalue().splitlines()
    assert printed[0].startswith("step 2/4 loss 3.0000 | 2,048 tok/s | MFU 200.0% | mem ")
    assert printed[1].startswith("step 4/4 loss 1.0000") and printed[2] == "step 4: eval loss 0.5000"
    assert printed[3] == "step 4: eval loss 0.5000 on the last 5 % of each source's tokens"  # what was held out


def test_a_record_is_one_line_in_a_file_at_any_length(tmp_path, capsys):
    """The console a run makes by default, writing to a file (`pretrain train > out.log`, a SLURM log):
    a step line longer than 80 columns stays one line (rich cuts at 80 off a terminal unless told not to)."""
    with MetricsLogger(tmp_path, total_steps=2, tokens_per_step=10) as log:  # progress on: off a terminal, plain lines
        log.log(1, 5.0, step_time=0.25, lr=1e-3, grad_norm=1.5, time_data_s=0.189, time_fwd_bwd_s=0.102,
                time_exposed_comm_s=0.006, time_optimizer_s=0.015, time_busy_max_s=0.329, time_busy_median_s=0.299,
                straggler_rank=1)
        log.message("pretrain: 2 ranks: tp=1 cp=1 pp=1 dp=2 ep=1, zero=no_shard; data <embedded seed=1234> "
                    "(unigram entropy 3.122 nats)")
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[0].startswith("step 1/2 loss 5.0000") and len(printed[0]) > 80, printed
    assert printed[1].endswith("(unigram entropy 3.122 nats)"), printed


def test_live_progress_on_a_terminal(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with MetricsLogger(tmp_path, total_steps=3, console=console, tokens_per_step=10) as log:
        for step in range(1, 4):
            log.log(step, 1.0, step_time=0.1)
    assert "3/3" in out.getvalue() and "loss 1.0000" in out.getvalue()


def test_tensorboard_is_optional(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    out = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=1, tensorboard=True, console=Console(file=out)) as log:
        log.log(1, 2.0, step_time=1.0)
    assert "tensorboard package is not installed" in out.getvalue()



def test_wandb_is_quiet_so_it_names_its_run_folder_once(tmp_path, monkeypatch):
    """W&B's own output is a setting: quiet keeps the start lines (mode, folder) and drops the end's
    repeat of the folder and of the last values. Faked here: a real wandb.init starts a service for
    the process's life and patches its console."""
    wandb = pytest.importorskip("wandb")
    seen = {}

    class Run:
        def log(self, *a, **k): ...
        def finish(self): seen["finished"] = True

    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or Run())
    with MetricsLogger(tmp_path, total_steps=1, progress=False, run_id="once", wandb={"project": "p"}) as log:
        log.log(1, 2.0, step_time=0.1)
    assert seen["settings"].quiet is True and seen["id"] == "once" and seen["finished"], seen


def test_tensorboard_writes_where_the_readme_says(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    from pathlib import Path

    with MetricsLogger(tmp_path, total_steps=1, tensorboard=True, progress=False) as log:
        log.log(1, 2.0, step_time=0.1)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert "TensorBoard (`[log] tensorboard = true`) gets the same keys, in `<log.dir>/tensorboard`" in readme
