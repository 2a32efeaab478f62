"""DualPipeV (DeepSeek): the V-shaped, single-copy variant of DualPipe.

Each rank holds chunks r and 2p-1-r, so microbatches flow down the ranks and back up, and in
the steady state each rank pairs the forward of one of its chunks with the backward of the
other (``F&B``: DeepSeek overlaps the two on GPU streams, hiding one's communication behind the
other's compute). The executor runs them back to back on one stream, with their communication
overlapped: both inputs of a pair come from one peer and both receives are posted before F waits
on its own (``p2p.POSTED_AHEAD``), and F's send is in flight while B computes.
Phases follow DeepSeek's reference order:
1 forwards on the down chunk, 2 down/up forward pairs, 3 up chunk B/W/F, 4 the main F&B loop,
5 up backward plus F&B, 6 backwards on both chunks (switching to split B/W half-way),
7 W then down backward, 8 the remaining W's.
"""

from __future__ import annotations

from collections import deque

from ..ir import Action, Schedule, make_schedule
from .chunk_ranks import v_chunk_ranks


def dualpipev(pp: int, microbatches: int) -> Schedule:
    # The recipe needs 2p microbatches; with fewer, plan for 2p and drop the missing ones.
    planned = max(2 * pp, microbatches)
    ranks = []
    for rank in range(pp):
        down, up = rank, 2 * pp - 1 - rank
        forwards = {down: 0, up: 0}
        backwards = {down: 0, up: 0}
        pending_w: deque[tuple[int, int]] = deque()
        order: list[Action] = []

        def forward(chunk: int) -> None:
            order.append(Action("F", forwards[chunk], chunk))
            forwards[chunk] += 1

        def backward(chunk: int, split: bool = False) -> None:
            m = backwards[chunk]
            backwards[chunk] += 1
            order.append(Action("B", m, chunk, split))
            if split:
                pending_w.append((m, chunk))

        def weight_if_pending() -> None:
            if pending_w:
                m, chunk = pending_w.popleft()
                order.append(Action("W", m, chunk))

        for _ in range(2 * (pp - rank - 1)):  # 1
            forward(down)
        for _ in range(rank + 1):  # 2
            forward(down)
            forward(up)
        for _ in range(pp - rank - 1):  # 3
            backward(up, split=True)
            weight_if_pending()
            forward(up)
        for _ in range(planned - 2 * pp + rank + 1):  # 4: (F down & B up), (F up & B down)
            forward(down)
            backward(up)
            forward(up)
            backward(down)
        for _ in range(pp - rank - 1):  # 5
            backward(up)
            forward(up)
            backward(down)
        split = False  # 6: the second half of these backwards defers its weight grads
        for i in range(rank + 1):
            if i == (rank + 1) // 2 and rank % 2 == 1:
                split = True
            backward(up, split)
            if i == (rank + 1) // 2 and rank % 2 == 0:
                split = True
            backward(down, split)
        for _ in range(pp - rank - 1):  # 7
            weight_if_pending()
            backward(down, split)
        while pending_w:  # 8
            weight_if_pending()
        ranks.append([a for a in order if a.microbatch < microbatches])
    return make_schedule("dualpipev", pp, microbatches, v_chunk_ranks(pp), ranks)
