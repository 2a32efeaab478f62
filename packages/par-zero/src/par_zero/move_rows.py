"""Moving rows of parameters to other ranks together with their optimizer state (expert re-placement).

A row is ``param[i]`` along dim 0 (one expert of a grouped expert weight). The ranks of ``group``
(an EP group) hold the same params with the same shapes in the same buckets. :func:`move_rows_`
moves rows between them: the fp32 master and every optimizer state kind (AdamW's moments, Muon's
momentum, a torch.optim class's tensors: whatever ``range_state`` holds), then re-assembles the
params from the masters, as after a step. A move without its state would leave a moved expert
stepping with another expert's moments.

Under ZeRO-1/2 a rank's optimizer range covers part of a row only, and the receiving rank's range
may cover another part: the sending rank's sharding group first sums the row's parts (each rank
writes its own part into zeros), the whole row travels, and each receiving rank keeps its range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from par_groups import comm


@dataclass(frozen=True)
class RowMove:
    """Row ``source_row`` of each of ``params`` on rank ``source`` of the group goes to row ``dest_row`` on ``dest``."""

    params: tuple[nn.Parameter, ...]
    source: int
    source_row: int
    dest: int
    dest_row: int


def _regions(dp, moves: list[RowMove], row_of) -> list[tuple[torch.Tensor, int, int]]:
    """Per move and param, ``(optimizer-range owner bucket, flat start in it, length)`` of the row."""
    where = {p: (b, o) for b in dp.buckets for p, o in zip(b.params, b.offsets)}
    out = []
    for m in moves:
        for p in m.params:
            if p not in where:
                raise ValueError("move_rows_ moves trained params of the wrapped module only")
            b, o = where[p]
            n = p[0].numel()
            out.append((b, o + row_of(m) * n, n))
    return out


@torch.no_grad()
def move_rows_(dp, moves: Sequence[RowMove], group: ProcessGroup | None) -> int:
    """Apply ``moves`` (the same list, in the same order, on every rank of ``group`` and of the params'
    sharding groups); returns the bytes the group's all-to-all carries between different ranks."""
    cfg = dp.cfg
    if cfg.torch_native or cfg.shard_params:
        raise ValueError(f"moving rows with their optimizer state supports zero no_shard/optim/optim_grads, "
                         f"not {cfg.strategy!r} (its params at rest are shards)")
    if not moves:
        return 0
    me, size = dist.get_rank(group), dist.get_world_size(group)
    send = sorted((m for m in moves if m.source == me), key=lambda m: m.dest)  # stable: list order per dest
    recv = sorted((m for m in moves if m.dest == me), key=lambda m: m.source)
    out_regions, in_regions = _regions(dp, send, lambda m: m.source_row), _regions(dp, recv, lambda m: m.dest_row)
    groups = {b.groups for b, _, _ in out_regions + in_regions}
    if len(groups) > 1:
        raise ValueError("move_rows_ moves params of one data-parallel family (all expert or all dense) at a time")
    row = lambda m: sum(p[0].numel() for p in m.params)  # noqa: E731
    input_splits = [sum(row(m) for m in send if m.dest == d) for d in range(size)]
    output_splits = [sum(row(m) for m in recv if m.source == s) for s in range(size)]
    moved = 0
    for kind in ("master",) + tuple(dp.optimizer.state_kinds()):
        state = {b: dp.optimizer.range_state(b, kind) for b in dp.buckets}
        parts = []
        for b, start, n in out_regions:  # this rank's part of each row sent, zeros elsewhere
            piece = state[b].new_zeros(n)
            lo, hi = max(start, b.opt_lo), min(start + n, b.opt_hi)
            if lo < hi:
                piece[lo - start:hi - start] = state[b][lo - b.opt_lo:hi - b.opt_lo]
            parts.append(piece)
        dtype = next(iter(state.values())).dtype
        payload = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=dp.buckets[0].device)
        if cfg.shard_optimizer and out_regions:  # the whole rows: the sharding group's parts summed
            comm.all_reduce(payload, out_regions[0][0].groups.inner)  # (outer 'optim' comes with ZeRO-3 only)
        received = payload.new_empty(sum(output_splits))
        comm.all_to_all_single(received, payload, group, output_splits, input_splits)
        at = 0
        for b, start, n in in_regions:  # keep this rank's range of each row received
            lo, hi = max(start, b.opt_lo), min(start + n, b.opt_hi)
            if lo < hi:
                state[b][lo - b.opt_lo:hi - b.opt_lo] = received[at + lo - start:at + hi - start]
            at += n
        moved += sum(row(m) for m in moves if m.source != m.dest) * payload.element_size()
    dp.sync_params()
    return moved
