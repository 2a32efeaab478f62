"""Shared by the bad-input sweeps: run a CLI line within a limit, and the one-line contract it must keep."""

import hashlib
import signal
from pathlib import Path

LIMIT_S = 60  # a line that has not answered by then hangs: it fails its case, not the whole run


def snapshot(root: Path) -> dict:
    """Every file under ``root`` by its SHA-256: a failed command changes nothing around it."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def invoke_within_limit(runner, app, args, limit_s: int = LIMIT_S):
    """``runner.invoke(app, args)``, a hang raising TimeoutError after ``limit_s``."""
    def hung(signum, frame):
        raise TimeoutError(f"no answer within {limit_s} s")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(limit_s)
    try:
        return runner.invoke(app, args)
    finally:
        signal.alarm(0)


def assert_one_error_line(res, name: str, words: str = "", code: int = 2) -> None:
    """Exit ``code`` (2: bad input), exactly one ``error:`` line holding ``words``, no traceback."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == code, (name, res.exit_code, res.output[-3000:], res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (name, res.stderr)
    assert "Traceback" not in res.output, (name, res.output)
