"""Zero-bubble schedules (Qi et al. 2023): the backward is split into B (input grad, sent on at
once) and W (weight grad), and the W's fill slots that would otherwise be idle.

* ``zb-h1``: 1F1B's order and memory, one chunk per rank; rank r holds back its first r W's so
  its B's reach the previous rank sooner, and runs them in the cooldown where 1F1B idles.
* ``zb-v``: two chunks per rank in a V (rank r holds chunks r and 2p-1-r), the paper's ZB-V
  order: warm up chunk r, then the V's second chunk, then steady F/B/W on both chunks.
"""

from __future__ import annotations

from ..ir import Action, Schedule, make_schedule
from .chunk_ranks import linear_chunk_ranks, v_chunk_ranks


def zb_h1(pp: int, microbatches: int) -> Schedule:
    ranks = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        order = [Action("F", m, rank) for m in range(warmup)]
        backwards = weights = 0

        def backward_then_maybe_weight() -> None:
            nonlocal backwards, weights
            order.append(Action("B", backwards, rank, split=True))
            backwards += 1
            if backwards > rank:  # the first `rank` W's wait for the cooldown
                order.append(Action("W", weights, rank))
                weights += 1

        for m in range(warmup, microbatches):
            order.append(Action("F", m, rank))
            backward_then_maybe_weight()
        while backwards < microbatches:
            backward_then_maybe_weight()
        order += [Action("W", m, rank) for m in range(weights, microbatches)]
        ranks.append(order)
    return make_schedule("zb-h1", pp, microbatches, linear_chunk_ranks(pp, 1), ranks)


def zb_v(pp: int, microbatches: int) -> Schedule:
    # The recipe needs at least 2p - 1 microbatches to fill the V; with fewer, plan for 2p - 1
    # and drop the actions of the microbatches that do not exist (the order stays valid).
    planned = max(2 * pp - 1, microbatches)
    ranks = []
    for rank in range(pp):
        down, up = rank, 2 * pp - 1 - rank  # the rank's chunk on the way down and on the way up
        count = {(k, c): 0 for k in "FBW" for c in (down, up)}
        order: list[Action] = []

        def add(kind: str, chunk: int) -> None:
            m = count[kind, chunk]
            count[kind, chunk] += 1
            order.append(Action(kind, m, chunk, split=(kind == "B")))

        for _ in range(2 * (pp - rank) - 1):
            add("F", down)
        for _ in range(rank):
            add("F", up)
            add("F", down)
        for _ in range(pp - rank):
            add("F", up)
            add("B", up)
            add("W", up)
        while count["F", up] < count["F", down] or count["F", down] < planned:
            if count["F", down] < planned:
                add("F", down)
            add("B", down)
            add("W", down)
            add("F", up)
            add("B", up)
            add("W", up)
        for _ in range(rank):
            add("B", down)
            add("B", up)
        for _ in range(pp - rank):
            add("B", down)
            add("W", down)
        while count["W", up] < count["B", up]:
            add("W", up)
        while count["W", down] < count["B", down]:
            add("W", down)
        ranks.append([a for a in order if a.microbatch < microbatches])
    return make_schedule("zb-v", pp, microbatches, v_chunk_ranks(pp), ranks)
