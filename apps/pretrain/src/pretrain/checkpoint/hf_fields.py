"""Reading one field of a Hugging Face ``config.json`` with its type checked.

The file is not ours: ``"tie_word_embeddings": "false"`` is a true string, ``"n_group": "8"``
breaks arithmetic later, ``"rope_scaling": [..]`` has no ``.get``. Every field we read goes through
:func:`hf_field`, so a wrong type is one :class:`~pretrain.errors.UsageError` naming the key.
"""

from __future__ import annotations

import math

from ..errors import UsageError

REQUIRED = object()  # no default: the key must be there
_WHAT = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a JSON object"}


def hf_field(hf: dict, key: str, kind: type, where: str, default=REQUIRED, low=None):
    """``hf[key]`` if it is a ``kind`` (an integer counts as a float, true/false as neither); ``default``
    when it is absent or null. ``low``: the smallest valid value of a number."""
    value = hf.get(key)
    if value is None:
        if default is REQUIRED:
            raise UsageError(f"{where}: missing {key}")
        return default
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise UsageError(f"{where}: {key}={value!r} must be {_WHAT[kind]}")
    if low is not None and value < low:
        raise UsageError(f"{where}: {key}={value!r} must be >= {low}")
    return float(value) if kind is float else value
