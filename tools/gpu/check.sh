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
#      plain-PyTorch baseline in the same process: RESULT gpu-1b tokens_per_s= mfu= ratio=
#   3. where Transformer Engine is installed: the same run with [model].backend=te, and with fp8.
# Without a CUDA GPU it prints one line and exits 0. Exit status 1 if any step failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

SRC=""
for dir in packages/*/src apps/pretrain/src; do SRC="$SRC:$ROOT/$dir"; done
for wheel in tools/gpu/vendor/*.whl; do [ -e "$wheel" ] && SRC="$SRC:$ROOT/$wheel"; done
export PYTHONPATH="${SRC#:}${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "tools/gpu/check.sh: no CUDA GPU visible to $PY (or no torch); nothing to check"
  exit 0
fi

FAILED=()
LOG="$(mktemp -d)/check.log"
run() {  # run NAME SECONDS COMMAND...: output shown and kept; a non-zero exit or a timeout is a failure
  local name="$1" seconds="$2"; shift 2
  echo "== $name (limit ${seconds}s)"
  timeout "$seconds" "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] || FAILED+=("$name: exit $status$([ "$status" -eq 124 ] && echo ' (timed out)')")
}

"$PY" tools/gpu/env.py
run "pytest -m gpu" 210 "$PY" -m pytest -p par_groups.testing.plugin -m gpu -q -rs packages/*/tests/test_gpu.py
run "1B Llama, par vs plain PyTorch" 210 "$PY" tools/gpu/llama_1b.py --steps 50
if "$PY" -c 'import transformer_engine.pytorch' 2>/dev/null; then
  run "1B Llama, Transformer Engine" 120 "$PY" tools/gpu/llama_1b.py --label gpu-1b-te --steps 30 \
    --no-baseline --set model.backend=te
  run "1B Llama, Transformer Engine fp8 (delayed scaling)" 120 "$PY" tools/gpu/llama_1b.py --label gpu-1b-te-fp8 \
    --steps 30 --no-baseline --set model.backend=te --set train.fp8=delayed
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
