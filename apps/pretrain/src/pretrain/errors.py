"""User-facing errors: one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import typer


class UsageError(ValueError):
    """Bad input from the user (config, layout, files); the message says what would be valid."""


class DamagedCheckpoint(UsageError):
    """A checkpoint's file is missing, truncated or not the bytes that were written."""


def damaged(path, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"checkpoint {path} is damaged: {what}")


def fail(message: str) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)
