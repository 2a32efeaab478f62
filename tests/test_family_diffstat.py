"""tools/family_diffstat.sh still builds HEAD without gpt-oss: its edits of the shared tests apply, the tree
left names gpt-oss nowhere, and outside the folder the sources differ by the one registry line."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_gpt_oss_is_its_folder_and_one_registry_line():
    out = subprocess.run(["bash", str(ROOT / "tools" / "family_diffstat.sh")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    changed = [line.split("|")[0].strip() for line in out.stdout.splitlines() if "|" in line]
    assert "apps/pretrain/src/pretrain/models/__init__.py" in changed
    assert all(p.startswith("apps/pretrain/src/pretrain/models/gpt_oss/") or "/tests/" in p or p.startswith("tests/")
               for p in changed if p != "apps/pretrain/src/pretrain/models/__init__.py"), changed
    assert out.stdout.rstrip().endswith('+    "gpt_oss",'), out.stdout[-500:]
