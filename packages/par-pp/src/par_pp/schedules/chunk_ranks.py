"""Which rank holds which chunk: round-robin (interleaved) or V-shaped (zb-v, dualpipev)."""

from __future__ import annotations


def linear_chunk_ranks(pp: int, vpp: int) -> list[int]:
    """Chunk c on rank c mod pp: the explainer's PP=4, VPP=2 layout (GPU 0 holds chunks 0 and 4)."""
    return [c % pp for c in range(pp * vpp)]


def v_chunk_ranks(pp: int) -> list[int]:
    """Two chunks per rank in a V: down the ranks for chunks 0..pp-1, back up for pp..2pp-1.

    Rank r holds chunks r and 2pp-1-r, so the first and the last chunk share rank 0 and the
    hand-off at the bottom of the V (chunk pp-1 to pp) stays on the last rank.
    """
    return [c if c < pp else 2 * pp - 1 - c for c in range(2 * pp)]
