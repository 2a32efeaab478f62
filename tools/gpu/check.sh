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
#   2. a ~1B Llama (16 layers, hidden 2048, seq 4096, bf16) for 50 steps with `pretrain` and with a
#      plain-PyTorch baseline in the same process: RESULT gpu-1b tokens_per_s= mfu= step_time_par_over_baseline= (below 1: par faster)
#   3. where Transformer Engine is installed: the same run with [model].backend=te, and with fp8.
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

MODEL=(); STEPS=50; TE_STEPS=30
if [ "${PAR_GPU_CHECK_ON_CPU:-0}" = 1 ]; then
  export PAR_GPU_TEST_DEVICE=cpu; MODEL=(--device cpu --tiny --warmup 1); STEPS=2; TE_STEPS=2
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
run "pytest -m gpu" 150 "$PY" -m pytest "${PLUGIN[@]}" -m gpu -q -rs packages/*/tests/test_gpu.py
run "1B Llama, par vs plain PyTorch" 210 "$PY" tools/gpu/llama_1b.py --steps "$STEPS" "${MODEL[@]}"
if "$PY" -c 'import transformer_engine.pytorch' 2>/dev/null; then
  run "1B Llama, Transformer Engine" 90 "$PY" tools/gpu/llama_1b.py --label gpu-1b-te --steps "$TE_STEPS" \
    --no-baseline --set model.backend=te "${MODEL[@]}"
  run "1B Llama, Transformer Engine fp8 (delayed scaling)" 90 "$PY" tools/gpu/llama_1b.py --label gpu-1b-te-fp8 \
    --steps "$TE_STEPS" --no-baseline --set model.backend=te --set train.fp8=delayed "${MODEL[@]}"
else
  echo "== Transformer Engine is not installed: the backend=te and fp8 runs are skipped"
fi

echo "== summary"
grep '^RESULT' "$LOG" || echo "no RESULT lines"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all GPU checks passed"
