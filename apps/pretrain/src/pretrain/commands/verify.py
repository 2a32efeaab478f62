"""`pretrain verify DIR`: check a checkpoint's files against the checksums written with it, offline."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import UsageError, fail

EXIT_DAMAGED = 2  # a file missing, truncated or not the bytes written (or not a checkpoint at all)
EXIT_UNVERIFIED = 3  # nothing found wrong, but some bytes could not be checked: never reported as ok


def verify(
    path: str = typer.Argument(..., help="A checkpoint (step_N), or a run's checkpoint directory: each step_N in it."),
) -> None:
    """Check every file of a checkpoint against its checksums.json: exit 0 if intact; one error line per damaged
    checkpoint and exit 2; else, for one that has no checksums.json (its bytes cannot be checked), exit 3."""
    from ..checkpoint.integrity import verify_checkpoint
    from ..checkpoint.retention import STATE_FILE, STEP_DIR

    root = Path(path)
    if (root / STATE_FILE).is_file():
        targets = [root]
    else:
        steps = root.iterdir() if root.is_dir() else ()
        targets = sorted((p for p in steps if STEP_DIR.fullmatch(p.name) and p.is_dir()), key=lambda p: int(p.name[5:]))
    if not targets:
        raise fail(f"{path} is not a checkpoint (no {STATE_FILE}) nor a directory holding step_N checkpoints")
    damaged = unverified = 0
    for target in targets:
        try:
            verified, summary = verify_checkpoint(target)
        except UsageError as e:
            typer.echo(f"error: {e}", err=True)
            damaged += 1
            continue
        if verified:
            typer.echo(f"ok: {summary}")
        else:
            typer.echo(f"error: {summary}", err=True)
            unverified += 1
    if damaged or unverified:
        raise typer.Exit(code=EXIT_DAMAGED if damaged else EXIT_UNVERIFIED)
