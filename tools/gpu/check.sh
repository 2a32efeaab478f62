#!/usr/bin/env bash
# The GPU check: one CUDA GPU, a bare Python with torch (no uv, no network), < 8 minutes on an H200.
#
#   tools/gpu/check.sh                 # PYTHON=python3 by default; PYTHON=/path/to/python to choose
#
# It runs this checkout from source (PYTHONPATH over every package's src/); pure-Python wheels a
# machine lacks can be dropped into tools/gpu/vendor/ (git-ignored) and are put on the path too,
# e.g. `pip download --no-deps tomli -d tools/gpu/vendor` on a machine with network (Python >= 3.11
# needs none: tomllib is built in). Steps:
#   1. pytest -m gpu: every package's CUDA tests against the CPU fp32 result (packages/*/tests/test_gpu.py)
#   2. a ~1B Llama (16 layers, hidden 2048, seq 4096, bf16) for 50 steps with `pretrain`, a plain-PyTorch
#      baseline and torchtitan (its Llama3 on the same shape, fused AdamW: tools/gpu/llama_1b.py) in the
#      same process, one line to paste into tools/bench/results/RESULTS.md:
#      RESULT gpu-1b tokens_per_s= (one GPU: per GPU) mfu= step_time_par_over_baseline= (below 1: par faster)
#        host_syncs_per_step= peak_mem_gb= baseline_peak_mem_gb= torchtitan_tokens_per_s=
#        step_time_par_over_torchtitan= torchtitan_peak_mem_gb=
#      torchtitan is raced only where it imports. A bare machine (torch alone) lacks it: the run prints
#      "torchtitan: not raced, it does not import ..." and step_time_par_over_torchtitan=n/a. Four
#      pure-Python wheels make it import there (measured: torch's own dependencies plus these, each
#      loaded from a zip on the path): `pip download --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro
#      docstring_parser -d tools/gpu/vendor` on a machine with network.
#   3. the step timing's exposed communication read from the collectives' own CUDA events
#      (tools/gpu/comm_events.py: a tiny model, NCCL on one rank, [log].timing on): each step's event
#      pairs and host syncs, each log step's parts, and one line
#      RESULT gpu-comm-events exposed_comm_ms= event_pairs_per_step= syncs_outside_log_steps= syncs_per_log_read=
#   4. where Transformer Engine is installed: the same run with [model].backend=te, and with fp8.
#   5. with PAR_GPU_CHECK_FP8=1 (beyond the default budget: raise CHECK_BUDGET_S by 200): the 1B run with
#      par's own FP8 ([train].fp8 = tensorwise, rowwise: torch._scaled_mm) against bf16 on the same GPU,
#      RESULT gpu-1b-fp8-<recipe> lines (tokens/s, MFU against the FP8 peak). Step 1 always runs par's FP8
#      operand and GEMM check (packages/par-tp/tests/test_gpu_fp8.py).
#   6. where 2 or more GPUs are visible: a dp2 `[train].fault_tolerance = "replica"` run, one rank per GPU
#      over NCCL, rank 1 SIGKILLed (the NCCL abort and the regroup), against a restart from the last
#      checkpoint (tools/bench/bench_replica_fault.py --device cuda), RESULT gpu-replica-fault lines; with
#      fewer GPUs one line says it needs 2.
# Without a CUDA GPU it prints one line and exits 0. Exit status 1 if any step failed.
# The whole check keeps to CHECK_BUDGET_S seconds (470: under 8 minutes): each step's limit is cut
# to what is left, and a step with under 20 s left is not run (and counts as a failure).
# PAR_GPU_CHECK_ON_CPU=1 runs the same steps on the CPU, with a tiny model and 2 steps: how the
# suite checks this script itself (tests/test_gpu_check_script.py).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

SRC=""
for dir in packages/*/src apps/pretrain/src; do SRC="$SRC:$ROOT/$dir"; done
for wheel in tools/gpu/vendor/*.whl; do [ -e "$wheel" ] && SRC="$SRC:$ROOT/$wheel"; done
export PYTHONPATH="${SRC#:}${PYTHONPATH:+:$PYTHONPATH}"

MODEL=(); STEPS=50; TE_STEPS=30; EVENTS=(--steps 12 --every 4)
if [ "${PAR_GPU_CHECK_ON_CPU:-0}" = 1 ]; then
  export PAR_GPU_TEST_DEVICE=cpu; MODEL=(--device cpu --tiny --warmup 1); STEPS=2; TE_STEPS=2
  EVENTS=(--steps 2 --every 2 --device cpu)
elif ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "tools/gpu/check.sh: no CUDA GPU visible to $PY (or no torch); nothing to check"
  exit 0
fi

BUDGET_S="${CHECK_BUDGET_S:-470}"
FAILED=()
LOG="$(mktemp -d)/check.log"
touch "$LOG"
run() {  # run NAME SECONDS COMMAND...: output shown and kept; a non-zero exit or a timeout is a failure
  local name="$1" seconds="$2" left=$((BUDGET_S - SECONDS)); shift 2
  if [ "$left" -lt 20 ]; then
    echo "== $name: not run, ${left}s of the ${BUDGET_S}s budget left"
    FAILED+=("$name: not run (budget spent)")
    return
  fi
  [ "$seconds" -le "$left" ] || seconds=$left
  echo "== $name (limit ${seconds}s)"
  timeout "$seconds" "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] || FAILED+=("$name: exit $status$([ "$status" -eq 124 ] && echo ' (timed out)')")
}

# the test harness's pytest plugin: named here on a bare Python, found by its entry point where installed
PLUGIN=(-p par_groups.testing.plugin)
"$PY" -c 'import sys, importlib.metadata as m; sys.exit(any(e.value.startswith("par_groups.") for e in
  m.entry_points(group="pytest11")))' || PLUGIN=()

"$PY" tools/gpu/env.py
# in this process, one GPU: the root's addopts without its pytest-xdist workers (a bare Python may lack xdist)
run "pytest -m gpu" 150 "$PY" -m pytest "${PLUGIN[@]}" -o "addopts=--import-mode=importlib -p no:cacheprovider" \
  -m gpu -q -rs packages/*/tests/test_gpu*.py
if "$PY" -c 'import torchtitan.models.llama3' 2>/dev/null; then
  echo "== torchtitan imports on $PY: the 1B run races it on the same shape"
else
  echo "== torchtitan does not import on $PY: the 1B run is not raced against it (step_time_par_over_torchtitan=n/a)"
fi
run "1B Llama, par vs plain PyTorch" 270 "$PY" tools/gpu/llama_1b.py --steps "$STEPS" "${MODEL[@]}"
run "exposed communication from CUDA events" 45 "$PY" tools/gpu/comm_events.py "${EVENTS[@]}"
if "$PY" -c 'import transformer_engine.pytorch' 2>/dev/null; then
  run "1B Llama, Transformer Engine" 90 "$PY" tools/gpu/llama_1b.py --label gpu-1b-te --steps "$TE_STEPS" --no-torchtitan \
    --no-baseline --set model.backend=te "${MODEL[@]}"
  run "1B Llama, Transformer Engine fp8 (delayed scaling)" 90 "$PY" tools/gpu/llama_1b.py --label gpu-1b-te-fp8 \
    --steps "$TE_STEPS" --no-baseline --no-torchtitan --set model.backend=te --set train.fp8=delayed "${MODEL[@]}"
else
  echo "== Transformer Engine is not installed: the backend=te and fp8 runs are skipped"
fi

if [ "${PAR_GPU_CHECK_FP8:-0}" = 1 ]; then
  for recipe in tensorwise rowwise; do
    run "1B Llama, par's FP8 ($recipe)" 100 "$PY" tools/gpu/llama_1b.py --label "gpu-1b-fp8-$recipe" --steps "$TE_STEPS" \
      --no-baseline --no-torchtitan --set "train.fp8=$recipe" "${MODEL[@]}"
  done
fi

GPUS=0
[ "${PAR_GPU_CHECK_ON_CPU:-0}" = 1 ] || GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if [ "$GPUS" -ge 2 ]; then
  run "replica fault on 2 GPUs (NCCL abort and regroup)" 120 "$PY" tools/bench/bench_replica_fault.py --device cuda \
    --steps 8 --kill-step 4 --every 2 --label gpu-replica-fault
else
  echo "== replica fault (NCCL abort and regroup): not run, it needs 2 GPUs ($GPUS visible)"
fi

echo "== summary"
grep '^RESULT' "$LOG" || echo "no RESULT lines"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all GPU checks passed"
