"""Cut a layered model into pipeline chunks: contiguous layer ranges, as even as possible."""

from __future__ import annotations


def split_layers(num_layers: int, num_chunks: int) -> list[range]:
    """``num_chunks`` contiguous ranges covering ``range(num_layers)``; sizes differ by at most one,
    the extra layers going to the earliest chunks (32 layers, 8 chunks -> 4 each, as in the
    explainer; 10 layers, 4 chunks -> 3, 3, 2, 2)."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be >= 1")
    if num_layers < num_chunks:
        raise ValueError(f"num_layers={num_layers} cannot fill num_chunks={num_chunks} (each chunk needs a layer); use at most {num_layers} chunks")
    base, extra = divmod(num_layers, num_chunks)
    ranges, start = [], 0
    for c in range(num_chunks):
        size = base + (1 if c < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges
