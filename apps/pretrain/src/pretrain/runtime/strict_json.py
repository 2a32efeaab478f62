"""JSON read back from a file that a user, or another program, can edit (a lock file, a checkpoint's
index files): :func:`loads` raises ValueError for anything that is not plain JSON, nesting too deep to
parse and NaN or Infinity included, so each reader turns every bad file into its one line."""

from __future__ import annotations

import json


def _not_a_number(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def loads(text: str | bytes, nan: bool = False) -> object:
    """``json.loads``, but ValueError (never RecursionError) for input nested too deeply, and for NaN or
    Infinity unless ``nan`` (a metrics log records a NaN loss as such)."""
    try:
        return json.loads(text, parse_constant=None if nan else _not_a_number)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
