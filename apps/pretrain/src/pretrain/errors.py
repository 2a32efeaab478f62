"""User-facing errors: one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import typer


class UsageError(ValueError):
    """Bad input from the user (config, layout, files); the message says what would be valid."""


class DamagedCheckpoint(UsageError):
    """A checkpoint's file is missing, truncated or not the bytes that were written."""


def shown(value, limit: int = 80) -> str:
    """``value`` as a short repr (nesting and long strings elided): a value read from a file, named in one line."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, limit, limit, limit
    text = r.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def damaged(path, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"checkpoint {path} is damaged: {what}")


def fail(message: str) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)
