"""GPipe: every forward, then every backward in reverse microbatch order (one chunk per rank)."""

from __future__ import annotations

from ..ir import Action, Schedule, make_schedule
from .chunk_ranks import linear_chunk_ranks


def gpipe(pp: int, microbatches: int) -> Schedule:
    ranks = []
    for rank in range(pp):
        forwards = [Action("F", m, rank) for m in range(microbatches)]
        backwards = [Action("B", m, rank) for m in reversed(range(microbatches))]
        ranks.append(forwards + backwards)
    return make_schedule("gpipe", pp, microbatches, linear_chunk_ranks(pp, 1), ranks)
