"""`pretrain verify DIR`: check a checkpoint's files against the checksums written with it, offline."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import UsageError, fail


def verify(
    path: str = typer.Argument(..., help="A checkpoint (step_N), or a run's checkpoint directory: each step_N in it."),
) -> None:
    """Check every file of a checkpoint against its checksums.json: exit 0 if intact, else one error line and exit 2."""
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
    damaged = 0
    for target in targets:
        try:
            typer.echo(f"ok: {verify_checkpoint(target)}")
        except UsageError as e:
            typer.echo(f"error: {e}", err=True)
            damaged += 1
    if damaged:
        raise typer.Exit(code=2)
