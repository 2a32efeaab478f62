"""`pretrain hang LOG_DIR`: the one-line hang summary from the ranks' flight records (any launcher)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import UsageError, fail
from ..runtime.dead_rank import notes_of_dir
from ..runtime.hang import FLIGHT_DIR, summary_of_dir


def hang(log_dir: Path = typer.Argument(..., help="A run's [log].dir (holding flight/rank_R.json).")) -> None:
    """Say which ranks wait in which collective and which rank has not arrived, from the flight
    records the ranks wrote when a collective timed out (or on SIGUSR1)."""
    if not log_dir.is_dir():
        raise fail(f"{str(log_dir)!r} is not a directory; give the [log].dir of a run")
    try:
        found, count = summary_of_dir(log_dir, notes_of_dir(log_dir))  # a dead rank named by its heartbeat
    except UsageError as e:
        raise fail(str(e))
    if found is None:
        where = f"{count} flight record(s)" if count else "no flight records"
        typer.echo(f"no hang recorded ({where} in {log_dir / FLIGHT_DIR})")
        return
    typer.echo(f"hang: {found.line}")
