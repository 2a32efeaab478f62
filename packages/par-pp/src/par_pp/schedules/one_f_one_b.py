"""1F1B: rank r runs p - r - 1 warmup forwards, then alternates one forward and one backward."""

from __future__ import annotations

from ..ir import Action, Schedule, make_schedule
from .chunk_ranks import linear_chunk_ranks


def one_f_one_b_order(pp: int, rank: int, microbatches: int, chunk: int, split: bool = False) -> list[Action]:
    """The 1F1B order of one rank (full backwards; ``split`` makes input-grad-only backwards)."""
    warmup = min(pp - rank - 1, microbatches)
    order = [Action("F", m, chunk) for m in range(warmup)]
    next_backward = 0
    for m in range(warmup, microbatches):
        order.append(Action("F", m, chunk))
        order.append(Action("B", next_backward, chunk, split))
        next_backward += 1
    order += [Action("B", m, chunk, split) for m in range(next_backward, microbatches)]
    return order


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    ranks = [one_f_one_b_order(pp, r, microbatches, r) for r in range(pp)]
    return make_schedule("1f1b", pp, microbatches, linear_chunk_ranks(pp, 1), ranks)
