#!/usr/bin/env bash
# gpt-oss as a diff: HEAD without the family (its folder, its registry line and its own test files), built
# in a temporary git worktree, then `git diff --stat` from that tree to HEAD over the app and packages.
# Fails unless the sources left name gpt-oss nowhere and, outside the folder, differ by one line.
#
#   tools/family_diffstat.sh           # the diffstat and the one line (sources only: what the suite runs)
#   tools/family_diffstat.sh --check   # also takes the gpt-oss cases out of the shared test files (edits
#                                      # written below; a drifted test stops it), then, in the tree without
#                                      # the folder: the family, config and import-cycle tests and a 2-step
#                                      # `pretrain train` (the app runs)
#   FAMILY_DIFF=1 tools/family_diffstat.sh   # also print the test lines it takes out
#
# The tree's sources are run with this checkout's .venv (uv sync first), the tree's src/ folders put first
# on PYTHONPATH so they shadow the editable installs.
set -euo pipefail

ROOT=$(git rev-parse --show-toplevel)
FOLDER=apps/pretrain/src/pretrain/models/gpt_oss
SOURCES=(':(glob)apps/*/src/**' ':(glob)packages/*/src/**')  # the sources, tests apart
TMP=$(mktemp -d)
TREE=$TMP/without-gpt-oss
cleanup() { git -C "$ROOT" worktree remove --force "$TREE" 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
git -C "$ROOT" worktree add --detach -q "$TREE" HEAD
cd "$TREE"

git rm -rq "$FOLDER" apps/pretrain/tests/test_gpt_oss.py tests/test_layouts_gpt_oss.py tests/test_family_diffstat.py
sed -i '/^    "gpt_oss",$/d' apps/pretrain/src/pretrain/models/__init__.py  # the registry line
[ "${1:-}" != "--check" ] || "$ROOT/.venv/bin/python" - <<'EOF'
import re
from pathlib import Path


def edit(path, old, new="", count=1):
    """Replace ``old`` (a literal, or a compiled pattern) exactly ``count`` times: a drifted test stops the script."""
    p = Path(path)
    text = p.read_text()
    pattern = old if isinstance(old, re.Pattern) else re.compile(re.escape(old))
    text, n = pattern.subn(new.replace("\\", "\\\\") if not isinstance(old, re.Pattern) else new, text)
    assert n == count, f"{path}: {pattern.pattern!r} matched {n} times, not {count}: update tools/family_diffstat.sh"
    p.write_text(text)


M = re.MULTILINE | re.DOTALL
# tests that name the family beside the others
edit("apps/pretrain/tests/test_config.py", '"gpt-oss-120b.toml", ')
edit("apps/pretrain/tests/test_simulate.py", re.compile(r"^def test_gpt_oss_120b_at_world_256_matches_the_plan\(\):\n.*?\n\n\n", M))
edit("apps/pretrain/tests/test_certify.py", re.compile(r"^# gpt-oss \(its window.*?\.items\(\)\}\n\n", M))
edit("apps/pretrain/tests/test_certify.py", ", *GPT_OSS_CONFIGS")
edit("apps/pretrain/tests/test_certify.py", " | GPT_OSS_CONFIGS")
edit("tests/hf_families.py", re.compile(r'^    if family == "gpt_oss":.*?(?=^    raise ValueError)', M))
edit("tests/hf_families.py", ', "gpt_oss": "GptOssForCausalLM"')
edit("tests/hf_families.py", re.compile(r'^            elif family == "gpt_oss":.*?\n.*?\n', re.MULTILINE))
edit("tests/test_hf_families.py", ",\nMixtral, DeepSeek-V3, gpt-oss (its sliding window, sinks, biases and clamped SwiGLU on 160 tokens).",
     ",\nMixtral, DeepSeek-V3.")
edit("tests/test_hf_families.py", ', "gpt_oss": ["parallel.ep=2"]')
edit("tests/test_hf_families.py", re.compile(r'^SEQ = .*$', re.MULTILINE), "SEQ = {family: 16 for family in FAMILIES}")
edit("tests/test_hf_families.py", ' or getattr(layer.mlp, "router", None)  # gpt-oss: router')
edit("tests/test_hf_families.py", re.compile(r'^# gpt-oss trains 160-token.*?for f in FAMILIES\]\)\n', M),
     '@pytest.mark.parametrize("family", FAMILIES)\n')
edit("tests/test_hf_families.py", ', "deepseek_v3", "gpt_oss")', ', "deepseek_v3")')
edit("tests/test_hf_families.py", re.compile(r'^# gpt-oss is the family this proves.*?for f in FAMILIES\]\)\n', M),
     '@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.extended) for f in FAMILIES])\n')
edit("tests/test_recompute_policies.py", "    from pretrain.models.gpt_oss import moe as gpt_oss_moe\n")
edit("tests/test_recompute_policies.py", "(te, gpt_oss_moe)", "(te,)")
edit("tests/test_recompute_policies.py", re.compile(r'^    "gpt-oss-tp2": .*?(?=^    "qwen3-next-tp2")', M))
edit("tests/test_recompute_policies.py", "# the newer families' own cores: gpt-oss's sink attention (and its clamped SwiGLU for moe_act), Qwen3-Next's",
     "# the newer families' own cores: Qwen3-Next's")
edit("tests/test_recompute_policies.py", "core_attn (and gpt-oss's moe_act) rerun", "core_attn reruns")
EOF

git add -A
[ -z "${FAMILY_DIFF:-}" ] || git diff --cached -R -- tests apps/pretrain/tests ':!*gpt_oss*' 
WITHOUT=$(git write-tree)
NAMED=("${SOURCES[@]}"); [ "${1:-}" != "--check" ] || NAMED=(apps packages tests)
left=$(git grep -n -I -E 'gpt_oss|gpt-oss|GptOss|GPT_OSS' "$WITHOUT" -- "${NAMED[@]}" || true)
[ -z "$left" ] || { echo "error: the tree without gpt-oss still names it:"; echo "$left"; exit 1; } >&2

echo "== git diff --stat <HEAD without gpt-oss> HEAD -- apps packages tests"
git diff --stat=120 "$WITHOUT" HEAD -- apps packages tests
echo "== the sources outside $FOLDER/"
git diff -U0 "$WITHOUT" HEAD -- "${SOURCES[@]}" ":(exclude)$FOLDER" | grep -E '^(\+\+\+|[-+][^-+])' || true
outside=$(git diff --numstat "$WITHOUT" HEAD -- "${SOURCES[@]}" ":(exclude)$FOLDER" | awk '{a += $1; d += $2} END {print a + 0, d + 0}')
[ "$outside" = "1 0" ] || { echo "error: outside $FOLDER/ the sources differ by (added, deleted) = ($outside), not one added line" >&2; exit 1; }

if [ "${1:-}" = "--check" ]; then
    export PYTHONPATH="$(ls -d "$TREE"/apps/*/src "$TREE"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
    PY=$ROOT/.venv/bin/python
    "$PY" -c "import pretrain, pretrain.models as m; assert pretrain.__file__.startswith('$TREE'), pretrain.__file__; print('== families without gpt-oss:', m.FOLDERS)"
    echo "== tests in the tree without gpt-oss"
    "$PY" -m pytest -q tests/test_no_import_cycles.py apps/pretrain/tests/test_model_families.py \
        apps/pretrain/tests/test_config_keys.py apps/pretrain/tests/test_config.py 2>&1 | tail -3
    echo "== pretrain train, 2 steps, in the tree without gpt-oss"
    "$PY" -m pretrain train --set train.steps=2 --set log.dir="$TMP/run" --set log.progress=false 2>&1 | tail -3
    echo "== pretrain plan gpt-oss-120b in the tree without gpt-oss (an unknown config: one error line)"
    "$PY" -m pretrain plan gpt-oss-120b --world 256 2>&1 | tail -1 || true
fi
