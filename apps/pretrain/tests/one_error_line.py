"""Shared by the bad-input sweeps: run a CLI line within a limit, and the one-line contract it must keep."""

import hashlib
from pathlib import Path


def snapshot(root: Path) -> dict:
    """Every file under ``root`` by its SHA-256: a failed command changes nothing around it."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def invoke_within_limit(runner, app, args):
    """``runner.invoke(app, args)``. A line that hangs fails its own case, not the whole run: the
    suite's per-test bound (pytest-timeout, ``timeout`` in pyproject.toml) raises in this thread."""
    return runner.invoke(app, args)


def assert_one_error_line(res, name: str, words: str = "") -> None:
    """Exit 2, exactly one ``error:`` line holding ``words``, no traceback."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, (name, res.exit_code, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (name, res.stderr)
    assert "Traceback" not in res.output, (name, res.output)
