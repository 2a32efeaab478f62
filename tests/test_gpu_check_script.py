"""tools/gpu on a machine without a GPU: the check script says so in one line and exits 0, its
Python parts import and run their CPU paths (the 1B script on a tiny model), and the `-m gpu`
tests pass with the CPU standing in for CUDA."""

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


def test_environment_report_and_tiny_1b_script_run_on_the_cpu():
    env = run(sys.executable, "tools/gpu/env.py")
    assert env.returncode == 0 and "flash-attn:" in env.stdout and "Transformer Engine:" in env.stdout, env.stderr
    res = run(sys.executable, "tools/gpu/llama_1b.py", "--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    result = [line for line in res.stdout.splitlines() if line.startswith("RESULT gpu-1b ")]
    assert len(result) == 1 and "tokens_per_s=" in result[0] and "mfu=n/a" in result[0] and "ratio=" in result[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU they run on it (tools/gpu/check.sh)")
def test_the_gpu_checks_pass_on_the_cpu():
    """Each package's `-m gpu` tests with their CUDA device swapped for the CPU: the checks
    themselves are right before a GPU runs them (their oracle once decayed the biases that
    DataParallel does not, a 1.1e-4 error no GPU kernel would have explained)."""
    tests = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("packages/*/tests/test_gpu.py"))
    res = run(sys.executable, "-m", "pytest", "-m", "gpu", "-q", *tests,
              env={"PAR_GPU_TEST_DEVICE": "cpu"})
    assert res.returncode == 0, res.stdout[-3000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout and "failed" not in res.stdout, res.stdout[-3000:]
