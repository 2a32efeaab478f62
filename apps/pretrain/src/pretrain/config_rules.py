"""Shared by the config modules: each check raises one :class:`~pretrain.errors.UsageError` line."""

from __future__ import annotations

import math

from .errors import UsageError


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _need(value in choices, f"{key}={value!r} is not one of {', '.join(choices)}")


def _positive(section: str, obj, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        low = 0 if allow_zero else 1
        _need(value >= low, f"[{section}].{name}={value} must be >= {low}")


def _divisors(n: int) -> str:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # O(sqrt n): n may be huge
    return ", ".join(str(d) for d in sorted(set(small + [n // d for d in small])))
