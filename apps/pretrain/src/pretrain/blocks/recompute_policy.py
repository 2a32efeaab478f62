"""``[model].recompute``: which modules of which decoder layers rerun their forward in the backward.

The value is one of the whole-model words (``none``, ``selective`` = the attention core,
``full`` = every decoder layer) or a list of Megatron's module names, each for every layer or for
a range of them: ``["core_attn", "mlp@0-15", "full@16-31"]`` (global layer indices, both ends
included). ``recompute.checkpointed`` reruns them exactly.
"""

from __future__ import annotations

import functools

# Megatron's --recompute-modules names, and full (the whole decoder layer)
MODULES = ("core_attn", "mlp", "moe_act", "layernorm", "mla_up_proj", "moe", "full")
WORDS = {"none": (), "selective": ("core_attn",), "full": ("full",)}


def _item(text: str) -> tuple[str, int, int | None]:
    """``"mlp"`` -> ("mlp", 0, None); ``"mlp@2-5"`` -> ("mlp", 2, 5); ``"mlp@3"`` -> ("mlp", 3, 3)."""
    name, _, span = text.partition("@")
    if not span:
        return name, 0, None
    first, _, last = span.partition("-")
    return name, int(first), int(last or first)


def parse_item(text: str) -> tuple[str, int, int | None] | None:
    """``_item`` or None where ``text`` is not ``module[@first[-last]]`` with a known module."""
    try:
        name, first, last = _item(text)
    except ValueError:
        return None
    ok = name in MODULES and first >= 0 and (last is None or last >= first)
    return (name, first, last) if ok else None


@functools.lru_cache(maxsize=None)
def _items(value) -> tuple[tuple[str, int, int | None], ...]:
    texts = WORDS[value] if isinstance(value, str) else tuple(value)
    return tuple(_item(t) for t in texts)


def modules_at(value, layer: int) -> frozenset[str]:
    """The modules recomputed in decoder layer ``layer`` under ``[model].recompute = value``."""
    return frozenset(name for name, first, last in _items(value) if first <= layer and (last is None or layer <= last))
