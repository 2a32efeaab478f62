"""The fault suite's slow cases (issue 38), runnable by anyone: ``uv run python tools/faults.py [CASE ...]``.

Each case runs ``pretrain train --nproc 2`` (a 2-layer tiny model, 6 steps, a checkpoint every 2)
in a process group of its own, hurts it, and records: the exit code, stderr's line count and first
line, the processes of the run still running 5 s after the launcher exited, what ``latest`` names,
and whether resuming gives bitwise the losses of the uninterrupted run. One table row per case
(Markdown); exit 1 when a row misses its expectation. ``--list`` names the cases.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FAULTS = Path(__file__).resolve().parents[1] / "tests" / "faults"
sys.path.insert(0, str(FAULTS))

from run_group import finish, kill_group, losses, start, wait_for_steps  # noqa: E402

BASE = ("model.layers=2", "train.steps=6", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
        "checkpoint.every=2", "checkpoint.keep=5", "train.collective_timeout_s=120")
RESUME = ("checkpoint.resume=true",)


@dataclass
class Row:
    case: str
    code: int | None = None
    lines: int = 0
    first: str = ""
    left: int = 0
    latest: str = ""
    resumed: str = "-"  # "equal" / "DIFFER" / "-" (not resumed)
    expect: dict = field(default_factory=dict)

    def ok(self) -> bool:
        expected = all(getattr(self, k) == v for k, v in self.expect.items())
        return expected and self.left == 0 and not self.resumed.startswith("DIFFER")

    def markdown(self) -> str:
        first = self.first.replace("|", "\\|")[:150]
        return (f"| {self.case} | {self.code} | {self.lines} | `{first}` | {self.left} | {self.latest} "
                f"| {self.resumed} | {'ok' if self.ok() else 'UNEXPECTED ' + str(self.expect)} |")


def _prelude(phase: str, rank: int, step: int) -> str:
    return (f"import sys, functools; sys.path.insert(0, {str(FAULTS)!r}); import fault_points, pretrain.training.run; "
            f"pretrain.training.run.run_rank = functools.partial(fault_points.fault_at, {phase!r}, {rank}, {step})")


def _run(row: Row, log: Path, *overrides: str, prelude: str = "", hurt=None) -> Row:
    proc = start(log, *BASE, *overrides, prelude=prelude)
    try:
        if hurt is not None:
            hurt(proc)
        row.code, err, left, _ = finish(proc, timeout_s=900)
    finally:
        kill_group(proc)
    lines = err.strip().splitlines()
    row.lines, row.first, row.left = len(lines), lines[0] if lines else "", len(left)
    marker = log / "checkpoints" / "latest"
    row.latest = marker.read_text().strip() if marker.is_file() else "(none)"
    return row


def _resume(row: Row, log: Path, reference: dict, *overrides: str) -> Row:
    again = _run(Row(row.case), log, *RESUME, *overrides)
    row.resumed = "equal" if again.code == 0 and losses(log) == reference else \
        f"DIFFER (exit {again.code}: {again.first[:80]})"
    return row


def _signal_group(log: Path, signum: int, twice: bool = False):
    def hurt(proc):
        wait_for_steps(log, 2, proc)
        os.killpg(proc.pid, signum)
        if twice:
            time.sleep(0.5)
            os.killpg(proc.pid, signum)
    return hurt


def _stopped_at_4(work: Path, name: str) -> Path:
    """A copy of a run stopped after step 4 (checkpoints step_2, step_4; latest step_4)."""
    log = work / name
    shutil.copytree(work / "stopped", log)
    return log


class Cases:
    def __init__(self, work: Path) -> None:
        self.work, self.reference = work, {}

    def prepare(self) -> list[Row]:
        """The uninterrupted run (the reference losses; also the 'success' exit) and one stopped at step 4."""
        ref = _run(Row("success (uninterrupted run)", expect={"code": 0, "lines": 0}), self.work / "reference")
        self.reference = losses(self.work / "reference")
        assert sorted(self.reference) == [1, 2, 3, 4, 5, 6], self.reference
        stopped = _run(Row("stop_at=4"), self.work / "stopped", "train.stop_at=4")
        assert stopped.code == 0 and stopped.latest == "step_4", stopped
        return [ref]

    def kill(self, phase: str, step: int, latest: str, *overrides: str) -> Row:
        row = Row(f"SIGKILL rank 1 in {phase} (step {step})", expect={"code": 1, "lines": 1, "latest": latest})
        log = self.work / f"kill-{phase}"
        _run(row, log, *overrides, prelude=_prelude(phase, 1, step))
        return _resume(row, log, self.reference, *overrides)

    def sigstop(self) -> Row:
        row = Row("SIGSTOP rank 1 (step 5) past train.collective_timeout_s=30", expect={"code": 1, "lines": 1, "latest": "step_4"})
        log = self.work / "sigstop"
        _run(row, log, "train.collective_timeout_s=30", prelude=_prelude("sigstop", 1, 5))
        return _resume(row, log, self.reference)

    def signal(self, name: str, signum: int, twice: bool, code: int) -> Row:
        row = Row(f"{name} to the run's process group" + (" twice" if twice else ""), expect={"code": code})
        log = self.work / name.lower()
        slow = (f"import sys, functools; sys.path.insert(0, {str(FAULTS)!r}); import fault_points, pretrain.training.run; "
                "pretrain.training.run.run_rank = functools.partial(fault_points.slow_steps, 1.0)")  # 1 s more per step
        _run(row, log, prelude=slow, hurt=_signal_group(log, signum, twice))
        return _resume(row, log, self.reference)

    def users_error_in_ranks(self) -> Row:
        row = Row("user's error inside the ranks (lr=1e30: NaN stop)", expect={"code": 2, "lines": 1})
        return _run(row, self.work / "nan", "train.lr=1e30", "train.min_lr=0", "train.warmup_steps=0")

    def damaged(self, what: str, damage) -> list[Row]:
        log = _stopped_at_4(self.work, f"damaged-{what.split()[0]}")
        damage(log / "checkpoints" / "step_4")
        refused = Row(f"{what} in latest, resume", expect={"code": 2, "lines": 1, "latest": "step_4"})
        _run(refused, log, *RESUME)
        fallback = Row(f"{what} in latest, resume with fallback = true", expect={"code": 0})
        _run(fallback, log, *RESUME, "checkpoint.fallback=true")
        fallback.resumed = "equal" if losses(log) == self.reference else "DIFFER"
        return [refused, fallback]

    def other_model(self) -> Row:
        log = _stopped_at_4(self.work, "other-model")
        return _run(Row("latest is another model's checkpoint", expect={"code": 2, "lines": 1}), log, *RESUME,
                    "model.hidden=32")

    def read_only(self) -> Row:
        log = _stopped_at_4(self.work, "read-only")
        ck = log / "checkpoints"
        row = Row("read-only checkpoint dir, resume", expect={"code": 2, "lines": 1, "latest": "step_4"})
        if not _mount(["--bind", str(ck), str(ck)]) or not _mount(["-o", "remount,bind,ro", str(ck)]):
            row.first, row.expect = "(skipped: cannot bind-mount read-only here; not root?)", {}
            return row
        try:
            _run(row, log, *RESUME)
        finally:
            subprocess.run(["umount", str(ck)], timeout=60)
        return _resume(row, log, self.reference)

    def disk_full(self) -> Row:
        small = self.work / "small"
        small.mkdir()
        row = Row("checkpoint dir full (2 MiB tmpfs)", expect={"code": 2, "lines": 1, "latest": "step_2"})
        if not _mount(["-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)]):
            row.first, row.expect = "(skipped: cannot mount a tmpfs here; not root?)", {}
            return row
        log = self.work / "full"
        try:
            _run(row, log, f"checkpoint.dir={small / 'ck'}")
            marker = small / "ck" / "latest"
            row.latest = marker.read_text().strip() if marker.is_file() else "(none)"
            shutil.copytree(small / "ck", log / "checkpoints")
        finally:
            subprocess.run(["umount", str(small)], timeout=60)
        return _resume(row, log, self.reference)


def _mount(args: list[str]) -> bool:
    try:
        return subprocess.run(["mount", *args], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


def all_cases(c: Cases) -> dict:
    return {
        "kill-forward": lambda: [c.kill("forward", 5, "step_4")],
        "kill-backward": lambda: [c.kill("backward", 5, "step_4")],
        "kill-optimizer": lambda: [c.kill("optimizer", 5, "step_4")],
        "kill-checkpoint": lambda: [c.kill("checkpoint", 4, "step_2")],
        "kill-upload": lambda: [c.kill("upload", 4, "step_2", "checkpoint.async_save=true")],
        "sigstop": lambda: [c.sigstop()],
        "sigterm": lambda: [c.signal("SIGTERM", signal.SIGTERM, False, 0)],
        "sigint-twice": lambda: [c.signal("SIGINT", signal.SIGINT, True, 130)],
        "user-error": lambda: [c.users_error_in_ranks()],
        "bit-flip": lambda: c.damaged("bit flipped in a shard", lambda d: _flip(d / "__1_0.distcp")),
        "truncated": lambda: c.damaged("truncated shard (64 KiB cut)", lambda d: (d / "__0_0.distcp").write_bytes(
            (d / "__0_0.distcp").read_bytes()[:-65536])),
        "foreign": lambda: c.damaged("foreign shard (step_2's)", lambda d: shutil.copy(
            d.parent / "step_2" / "__1_0.distcp", d / "__1_0.distcp")),
        "other-model": lambda: [c.other_model()],
        "read-only": lambda: [c.read_only()],
        "disk-full": lambda: [c.disk_full()],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="cases to run (default: all)")
    parser.add_argument("--list", action="store_true", help="name the cases and exit")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories (printed)")
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pretrain-faults-"))
    cases = Cases(work)
    table = all_cases(cases)
    if opts.list:
        print("\n".join(table))
        return 0
    unknown = [n for n in opts.cases if n not in table]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; --list names them")
    print("| case | exit | stderr lines | first line | left running after 5 s | latest after | resumed losses vs "
          "uninterrupted | |\n|---|---|---|---|---|---|---|---|", flush=True)
    start_s = time.monotonic()
    rows = cases.prepare()
    print(rows[0].markdown(), flush=True)
    for name in opts.cases or table:
        t = time.monotonic()
        for row in table[name]():
            rows.append(row)
            print(row.markdown() + f" <!-- {time.monotonic() - t:.0f} s -->", flush=True)
    print(f"\n{len(rows)} cases in {time.monotonic() - start_s:.0f} s; runs under {work}", flush=True)
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.ok() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
