"""`pretrain certify [CONFIG]`: the user's layout, narrowed, against the same model on one rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import UsageError, fail


def _reference_entry(config, overrides, steps, work, ids, device, timeout_s):
    from ..certify.ranks import run_reference
    from ..certify.stopping import end_rank_on_sigterm
    from ..runtime.launch import init_distributed, shutdown

    end_rank_on_sigterm()
    init_distributed(timeout_s, device)
    try:
        return run_reference(config, overrides, steps, work, ids)
    finally:
        shutdown()


def _layout_entry(config, overrides, steps, work, margin, ids, device, timeout_s):
    from ..certify.ranks import run_layout
    from ..certify.stopping import end_rank_on_sigterm
    from ..runtime.launch import init_distributed, shutdown

    end_rank_on_sigterm()
    init_distributed(timeout_s, device)
    try:
        return run_layout(config, overrides, steps, work, margin, ids)
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
    from ..runtime.launch import Aborted, RankFailed, check_nproc, under_torchrun
    from ..certify.narrow import check_certifiable, narrowed_overrides
    from ..certify.stopping import stopped_by_signals

    started = time.time()
    try:
        with stopped_by_signals():  # SIGTERM / Ctrl-C: the ranks stopped, one line, exit 143 / 130
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
            leader = (not torchrun or os.environ.get("RANK") == "0") and not reference_only
            if leader:
                from ..certify.output import owned

                with owned(work):  # its lock held, no other run's checkpoints in it
                    code = _run(config, overrides, ov, cfg, layout, n, steps, work, margin, reference_only, started)
            else:
                from ..training.preflight import check_writable

                check_writable(work, "--out")
                code = _run(config, overrides, ov, cfg, layout, n, steps, work, margin, reference_only, started)
    except UsageError as e:
        raise fail(str(e))
    except Aborted as e:  # a signal (see certify/stopping.py)
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=e.exit_code)
    except RankFailed as e:
        if e.usage:
            raise fail(e.error.removeprefix("UsageError: ").strip())
        typer.echo(f"error: rank {e.rank} failed: {e.error}", err=True)
        raise typer.Exit(code=1)
    raise typer.Exit(code=code)


def _run(config, overrides, ov, cfg, layout, n, steps, work: Path, margin, reference_only, started) -> int:
    """The reference, then the layout; the verdict line and report (global rank 0); the exit code."""
    from ..certify import coverage
    from ..certify.narrow import reference_overrides
    from ..certify.verdict import MARGIN, verdict_line, write_report
    from ..runtime.launch import launch, under_torchrun

    torchrun = under_torchrun()
    ids = coverage.edge_ids(cfg.model, layout.tp)
    ref_ov = ov + reference_overrides(cfg, layout)
    timeout = cfg.train.collective_timeout_s
    if reference_only or not torchrun:
        launch(_reference_entry, (config, ref_ov, steps, str(work), ids, "cpu", timeout), nproc=1, device="cpu")
        if reference_only:
            return 0
    else:
        _reference_under_torchrun(config, overrides, n, steps, work, timeout)
    records = launch(_layout_entry, (config, ov, steps, str(work), margin or MARGIN, ids, "cpu", timeout),
                     nproc=n, device="cpu", join_timeout_s=timeout)[0]
    name = (f"tp={layout.tp} cp={layout.cp} pp={layout.pp} dp={layout.dp} ep={layout.ep} "
            f"sp={'on' if layout.sequence_parallel else 'off'} zero={cfg.parallel.zero} schedule={cfg.parallel.schedule}")
    line, code = verdict_line(records, name)
    if not torchrun or os.environ.get("RANK") == "0":
        t = cfg.train
        vocabulary = {"tp": layout.tp, "shard_edges": ids, "covered": coverage.covered(ids, t.global_batch, t.seq_len, steps),
                      "per_sequence": coverage.per_sequence(ids, t.global_batch, t.seq_len)}
        write_report(work / "report.json", name, ov, records, line, code, vocabulary)
        typer.echo(f"{line} [report {work / 'report.json'}, {time.time() - started:.0f} s]")
    return code


def _reference_under_torchrun(config, overrides, n: int, steps, work: Path, timeout: float) -> None:
    """Under torchrun: global rank 0 runs the reference as a one-rank process of its own; the others
    wait for its file (the work directory must be shared, as a checkpoint directory is)."""
    done = work / "reference.done"
    if os.environ.get("RANK") == "0":
        done.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                            "MASTER_ADDR", "MASTER_PORT") and not k.startswith("TORCHELASTIC")}
        cmd = [sys.executable, "-m", "pretrain", "certify"] + ([config] if config else [])
        cmd += [a for o in overrides for a in ("--set", o)] + ["--nproc", str(n), "--steps", str(steps), "--out", str(work),
                                                        "--reference-only"]
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
