"""`pretrain certify [CONFIG]`: the user's layout, narrowed, against the same model on one rank."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import UsageError, fail


def _reference_entry(config, overrides, steps, work, device, timeout_s):
    from ..certify.ranks import run_reference
    from ..runtime.launch import init_distributed, shutdown

    init_distributed(timeout_s, device)
    try:
        return run_reference(config, overrides, steps, work)
    finally:
        shutdown()


def _layout_entry(config, overrides, steps, work, margin, device, timeout_s):
    from ..certify.ranks import run_layout
    from ..runtime.launch import init_distributed, shutdown

    init_distributed(timeout_s, device)
    try:
        return run_layout(config, overrides, steps, work, margin)
    finally:
        shutdown()


def certify(
    config: Optional[str] = typer.Argument(None, help="TOML config (default: the embedded tiny.toml) or a shipped name."),
    overrides: List[str] = typer.Option([], "--set", help="Override a key (after certify's narrowing): --set section.key=value."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Local ranks (default [train].nproc); ignored under torchrun."),
    steps: int = typer.Option(3, "--steps", help="fp32 steps to compare, each from the reference's state."),
    out: Optional[str] = typer.Option(None, "--out", help="Where the report and the reference's checkpoints go (default <log.dir>/certify)."),
    margin: Optional[float] = typer.Option(None, "--margin", help="Allowed multiple of the reference's fp32-vs-fp64 noise (default 4)."),
    reference_only: bool = typer.Option(False, "--reference-only", hidden=True),
) -> None:
    """Certify that this layout trains the same model as one rank: `certified: ...` (exit 0) or
    `NOT certified: ...` naming the first module that differs (exit 3); a JSON report beside it."""
    from ..config import load_config
    from ..runtime.launch import RankFailed, check_nproc, launch, under_torchrun
    from ..certify.narrow import check_certifiable, narrowed_overrides, reference_overrides
    from ..certify.verdict import MARGIN, verdict_line, write_report

    started = time.time()
    try:
        if steps < 1:
            raise UsageError(f"--steps {steps} must be >= 1")
        if margin is not None and not margin >= 1:
            raise UsageError(f"--margin {margin} must be >= 1")
        user = load_config(config, overrides)
        torchrun = under_torchrun()
        n = int(os.environ["WORLD_SIZE"]) if torchrun else (nproc if nproc is not None else user.train.nproc)
        if not torchrun:
            check_nproc(n, "cpu")
        ov = narrowed_overrides(config, overrides, n)
        cfg = load_config(config, ov)
        layout = cfg.validate_world(n)
        check_certifiable(cfg, layout)
        work = Path(out or Path(cfg.log.dir) / "certify")
        work.mkdir(parents=True, exist_ok=True)
        ref_ov = ov + reference_overrides(cfg, layout)
        timeout = cfg.train.collective_timeout_s
        if reference_only:
            launch(_reference_entry, (config, ref_ov, steps, str(work), "cpu", timeout), nproc=1, device="cpu")
            return
        if not torchrun:
            launch(_reference_entry, (config, ref_ov, steps, str(work), "cpu", timeout), nproc=1, device="cpu")
        else:
            _reference_under_torchrun(config, overrides, steps, work, timeout)
        records = launch(_layout_entry, (config, ov, steps, str(work), margin or MARGIN, "cpu", timeout),
                         nproc=n, device="cpu", join_timeout_s=timeout)[0]
    except UsageError as e:
        raise fail(str(e))
    except RankFailed as e:
        if e.usage:
            raise fail(e.error.removeprefix("UsageError: ").strip())
        typer.echo(f"error: rank {e.rank} failed: {e.error}", err=True)
        raise typer.Exit(code=1)
    name = (f"tp={layout.tp} cp={layout.cp} pp={layout.pp} dp={layout.dp} ep={layout.ep} "
            f"sp={'on' if layout.sequence_parallel else 'off'} zero={cfg.parallel.zero} schedule={cfg.parallel.schedule}")
    line, code = verdict_line(records, name)
    if not torchrun or os.environ.get("RANK") == "0":
        write_report(work / "report.json", name, ov, records, line, code)
        typer.echo(f"{line} [report {work / 'report.json'}, {time.time() - started:.0f} s]")
    raise typer.Exit(code=code)


def _reference_under_torchrun(config, overrides, steps, work: Path, timeout: float) -> None:
    """Under torchrun: global rank 0 runs the reference as a one-rank process of its own; the others
    wait for its file (the work directory must be shared, as a checkpoint directory is)."""
    done = work / "reference.done"
    if os.environ.get("RANK") == "0":
        done.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                            "MASTER_ADDR", "MASTER_PORT") and not k.startswith("TORCHELASTIC")}
        cmd = [sys.executable, "-m", "pretrain", "certify"] + ([config] if config else [])
        cmd += [a for o in overrides for a in ("--set", o)] + ["--steps", str(steps), "--out", str(work), "--reference-only"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise UsageError(f"the reference failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        done.write_text("ok\n")
        return
    deadline = time.time() + max(timeout, 600)
    while not done.exists():
        if time.time() > deadline:
            raise UsageError(f"the reference (rank 0) did not finish within {max(timeout, 600):g} s")
        time.sleep(0.5)
