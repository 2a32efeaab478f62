"""Interleaved 1F1B (Megatron's virtual pipeline): v chunks per rank, chunk c on rank c mod p.

Microbatches go in groups of p. Within a group a rank runs the group's forwards on its first
chunk, then on its second, ...; backwards go through the chunks in reverse. Rank r first runs
(v - 1) p + 2 (p - r - 1) warmup forwards, then alternates one forward and one backward.
When p does not divide the microbatches the last group takes the remainder (Megatron-Core's
rule), so 9 microbatches on p=4 go in groups of 4 and 5.
"""

from __future__ import annotations

from ..ir import Action, Schedule, make_schedule
from .chunk_ranks import linear_chunk_ranks


def _virtual_order(pp: int, vpp: int, microbatches: int, reverse_chunks: bool) -> list[tuple[int, int]]:
    """(microbatch, local chunk) pairs in the order a rank visits them."""
    order = []
    for first in range(0, microbatches, pp):
        last_group = first + 2 * pp > microbatches  # the last group takes the remainder too
        group = range(first, microbatches if last_group else first + pp)
        locals_ = reversed(range(vpp)) if reverse_chunks else range(vpp)
        for local in locals_:
            order += [(m, local) for m in group]
        if last_group:
            break
    return order


def interleaved(pp: int, microbatches: int, vpp: int) -> Schedule:
    total = microbatches * vpp
    forwards = _virtual_order(pp, vpp, microbatches, reverse_chunks=False)
    backwards = _virtual_order(pp, vpp, microbatches, reverse_chunks=True)
    # The last rank must run ahead far enough that each backward finds its forward done:
    # (v - 1) p forwards for equal groups, (v - 1) x the largest group in general.
    forward_index = {step: i for i, step in enumerate(forwards)}
    lead = max(forward_index[step] - j for j, step in enumerate(backwards))
    ranks = []
    for rank in range(pp):
        chunk = lambda local: local * pp + rank  # noqa: E731 - local chunk -> global chunk id
        warmup = min(lead + 2 * (pp - rank - 1), total)
        order = [Action("F", m, chunk(l)) for m, l in forwards[:warmup]]
        for i in range(warmup, total):
            m, l = forwards[i]
            order.append(Action("F", m, chunk(l)))
            m, l = backwards[i - warmup]
            order.append(Action("B", m, chunk(l)))
        order += [Action("B", m, chunk(l)) for m, l in backwards[total - warmup :]]
        ranks.append(order)
    return make_schedule("interleaved", pp, microbatches, linear_chunk_ranks(pp, vpp), ranks)
