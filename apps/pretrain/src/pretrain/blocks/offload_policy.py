"""``[model].offload``'s items: which modules of which decoder layers keep their saved activations in host
memory (offload.py moves them)."""

from __future__ import annotations

# the modules an item may name, and the whole layer
MODULES = ("attn", "mlp", "moe", "layernorm", "layer")


def parse_item(text: str) -> tuple[str, int, int | None] | None:
    """``"mlp"`` -> ("mlp", 0, None); ``"mlp@2-5"`` -> ("mlp", 2, 5); ``"layers:2"`` -> ("layers", 2, None)."""
    try:
        if text.startswith("layers:"):
            n = int(text[len("layers:"):])
            return ("layers", n, None) if n >= 1 else None
        name, _, span = text.partition("@")
        first, last = (0, None) if not span else (int(span.partition("-")[0]), int(span.partition("-")[2] or span.partition("-")[0]))
    except ValueError:
        return None
    ok = name in MODULES and first >= 0 and (last is None or last >= first)
    return (name, first, last) if ok else None


def modules_at(items, layer: int, position: int | None) -> frozenset[str]:
    """The modules offloaded in decoder layer ``layer``, the ``position``-th of its chunk (None: an MTP
    layer, which ``layers:N`` does not count)."""
    out = set()
    for text in items:
        name, first, last = parse_item(text)
        if name == "layers":
            if position is not None and position < first:
                out.add("layer")
        elif first <= layer and (last is None or layer <= last):
            out.add(name)
    return frozenset(out)
