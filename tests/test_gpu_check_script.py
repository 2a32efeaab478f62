"""tools/gpu on a machine without a GPU: the check script says so in one line and exits 0; with
PAR_GPU_CHECK_ON_CPU=1 it runs every step on the CPU (the `-m gpu` tests with the CPU standing in
for CUDA, the 1B script on a tiny model) and passes; it keeps to its time budget."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd, env=None):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_check_script_without_cuda_prints_one_line_and_exits_0():
    res = run("bash", "tools/gpu/check.sh", env={"PYTHON": sys.executable})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines() == [
        f"tools/gpu/check.sh: no CUDA GPU visible to {sys.executable} (or no torch); nothing to check"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU they run on it (tools/gpu/check.sh)")
@pytest.mark.extended  # the script's steps are the default tier's own tests and scripts, run once more through it
@pytest.mark.timeout(900)
def test_the_check_script_runs_every_step_on_the_cpu():
    """check.sh itself with PAR_GPU_CHECK_ON_CPU=1: the environment report, each package's `-m gpu`
    tests with the CPU standing in for CUDA (so the checks are right before a GPU runs them: their
    oracle once decayed the biases that DataParallel does not, a 1.1e-4 error no GPU kernel would
    have explained), the 1B script on a tiny model, the exposed-communication script, and the summary."""
    res = run("bash", "tools/gpu/check.sh", env={"PYTHON": sys.executable, "PAR_GPU_CHECK_ON_CPU": "1"})
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-2000:]
    assert "flash-attn:" in out and "Transformer Engine:" in out
    gpu_tests = out.split("== pytest -m gpu")[1].split("== 1B Llama")[0]
    assert " passed" in gpu_tests and "skipped" not in gpu_tests and "failed" not in gpu_tests, gpu_tests
    summary = out.split("== summary")[1].strip().splitlines()
    assert len(summary) == 3 and summary[2] == "all GPU checks passed", summary
    assert summary[0].startswith("RESULT gpu-1b tokens_per_s=") and " mfu=n/a step_time_par_over_baseline=" in summary[0], summary
    assert summary[1].startswith("RESULT gpu-comm-events exposed_comm_ms=") and " syncs_outside_log_steps=0 " in summary[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.timeout(300)  # the script's environment report imports torch and the GPU libraries
def test_the_check_script_keeps_to_its_budget():
    """With under 20 s of CHECK_BUDGET_S left a step is not run, and that is a failure (exit 1)."""
    res = run("bash", "tools/gpu/check.sh", env={"PYTHON": sys.executable, "PAR_GPU_CHECK_ON_CPU": "1",
                                                 "CHECK_BUDGET_S": "10"})
    assert res.returncode == 1, res.stdout[-3000:]
    assert "FAILED: pytest -m gpu: not run (budget spent)" in res.stdout
    assert "FAILED: 1B Llama, par vs plain PyTorch: not run (budget spent)" in res.stdout
    assert "FAILED: exposed communication from CUDA events: not run (budget spent)" in res.stdout
    assert "no RESULT lines" in res.stdout and "RESULT gpu-1b" not in res.stdout and not res.stderr, res.stderr
