"""Shared by the config modules: each check raises one :class:`~pretrain.errors.UsageError` line."""

from __future__ import annotations

import math

from ..errors import UsageError


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


def _in_range(key: str, value, low, high, why: str = "") -> None:
    _need(low <= value <= high, f"{key}={value} must be in {low}..{high}{why}")


# Model sizes far above any real model (DeepSeek-V3: 61 layers, hidden 7168, 256 experts): beyond
# them planning alone loops for minutes over layers, or the sizes overflow what a step could hold.
MAX_SIZES = {"layers": 10_000, "hidden": 1 << 20, "heads": 1 << 16, "kv_heads": 1 << 16, "ffn_hidden": 1 << 22,
             "vocab_size": 1 << 24, "num_experts": 1 << 16, "moe_ffn_hidden": 1 << 22, "kv_channels": 1 << 16,
             "mtp_depth": 64, "shared_experts": 1 << 10}


def _at_most(section: str, obj, limits: dict) -> None:
    for name, high in limits.items():
        value = getattr(obj, name)
        _need(value <= high, f"[{section}].{name}={value} is more than {high:,}, far above any real model; give a "
                             f"real size")


MAX_SEED = 2**32 - 1  # what every RNG we seed takes (numpy's, torch's, our per-tensor streams)
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is no timeout at all, and near 1e9 s timedelta/threading overflow


def _seed(key: str, value: int) -> None:
    _in_range(key, value, 0, MAX_SEED, " (2**32 - 1)")


def _timeout(key: str, value: float) -> None:
    _need(0 < value <= MAX_TIMEOUT_S, f"{key}={value} must be in (0, {MAX_TIMEOUT_S:g}] seconds (a week)")


def _divisors(n: int) -> str:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # O(sqrt n): n may be huge
    return ", ".join(str(d) for d in sorted(set(small + [n // d for d in small])))
