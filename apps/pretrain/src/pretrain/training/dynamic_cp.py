"""Dynamic context parallelism for packed documents (Megatron's --hybrid-context-parallel).

``[parallel] dynamic_cp = true``: per optimizer step, every document piece of the global batch
(a sub-sample: one document's tokens inside one sequence window) is placed by par-cp's
``schedule_subsamples`` on an aligned power-of-two block of the dp x cp ranks, sized to its length
(``max_seq_per_rank`` tokens per rank): short documents stay on one rank and attend locally, long
ones are split zigzag over their block and attend by ring (one cached process group per block).
Blocks are chosen to balance causal attention work, and a new round (micro-batch) opens when no
block has room. A document spread over ``s`` ranks is padded to a multiple of ``2 s`` tokens with
predictions that count for nothing; a rank left empty in a round gets one such token.

The math is static CP's with ``document_mask``: attention never crosses a document, RoPE positions
count from each document's start (RoPE is relative, so that is the same attention), and the loss is
the sum over the kept predictions of the global batch divided by their number, so the gradients
averaged over dp x cp are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from par_cp import attention_work, ring_attention, schedule_subsamples, segment_attention, shard_segments

from ..data.packing import IGNORE, mask_eod_labels

PAD = 0  # token id of a padding position (its prediction is ignored, so its id does not matter)


@dataclass(frozen=True)
class Piece:
    """One document's share on this rank: local rows [start, end), and how it attends."""

    start: int
    end: int
    group: object  # the block's process group; None: the document is on this rank alone
    segments: tuple  # the zigzag token ranges of every block rank (ring order); ((0, n),) alone


@dataclass(frozen=True)
class DynamicDocuments:
    """One round's attention plan on this rank (given to the model like ``packing.Documents``)."""

    pieces: tuple[Piece, ...]
    positions: torch.Tensor  # [T, 1] RoPE positions within each document

    def attend(self, q, k, v, scale: float, backend: str) -> torch.Tensor:
        """Causal attention of every piece: locally, or by ring over its block."""
        outs = []
        for p in self.pieces:
            qs, ks, vs = q[p.start:p.end], k[p.start:p.end], v[p.start:p.end]
            if p.group is None:
                outs.append(segment_attention(qs, ks, vs, p.segments, p.segments, True, None, scale, backend))
            else:
                outs.append(ring_attention(qs, ks, vs, p.group, p.segments, True, None, scale, backend))
        return torch.cat(outs)


class SpanGroups:
    """The process groups of every aligned block of 2, 4, ... dp x cp ranks, created once."""

    def __init__(self, ranks: tuple[int, ...]):
        self.ranks, self.me = ranks, ranks.index(dist.get_rank())
        self.groups = {}
        span = 2
        while span <= len(ranks):
            for first in range(0, len(ranks), span):  # every rank creates every group, in one order
                group = dist.new_group(sorted(ranks[first:first + span]))
                if first <= self.me < first + span:
                    self.groups[span] = group
            span *= 2


def subsamples(segments: torch.Tensor) -> list[tuple[int, int, int]]:
    """(sequence, start, end) of every document piece of ``segments [G, S]``, in order."""
    out = []
    for g, row in enumerate(segments.tolist()):
        start = 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[i - 1]:
                out.append((g, start, i))
                start = i
    return out


def schedule(batch, max_seq_per_rank: int, width: int):
    """Every document piece of the global ``batch`` (:func:`subsamples`) and its block of the ``width`` ranks."""
    subs = subsamples(batch.input_segments)
    return subs, schedule_subsamples([e - s for _, s, e in subs], max_seq_per_rank, width, balance="compute")


def led_pieces(batch, max_seq_per_rank: int, groups: SpanGroups) -> list[tuple[int, int, int, int]]:
    """(sequence, start, end, span) of each piece of ``batch`` whose block this rank leads (its first rank), so
    that every piece of the batch is named by exactly one rank of the plan."""
    subs, sched = schedule(batch, max_seq_per_rank, len(groups.ranks))
    return [(g, s, e, p.span) for (g, s, e), p in zip(subs, sched.spans) if p.ranks[0] == groups.me]


def plan_step(batch, eos: int | None, eod_mask_loss: bool, max_seq_per_rank: int, groups: SpanGroups):
    """This rank's rounds of the global ``batch``: (tokens [T, 1], labels [T, 1], DynamicDocuments)
    per round, the number of kept predictions of the batch, and each rank's attention work."""
    inputs, labels = batch.inputs, batch.labels
    if eod_mask_loss:
        labels = mask_eod_labels(inputs, labels, eos)
    subs, sched = schedule(batch, max_seq_per_rank, len(groups.ranks))
    work = [0.0] * len(groups.ranks)
    rounds = [([], [], [], []) for _ in range(sched.num_rounds)]  # tokens, labels, positions, pieces
    for (g, s, e), p in zip(subs, sched.spans):
        for r in p.ranks:
            work[r] += attention_work(e - s, p.span)
        if groups.me not in p.ranks:
            continue
        x, y = inputs[g, s:e], labels[g, s:e]
        n = e - s if p.span == 1 else math.ceil((e - s) / (2 * p.span)) * 2 * p.span
        x = torch.cat([x, x.new_full((n - (e - s),), PAD)])
        y = torch.cat([y, y.new_full((n - (e - s),), IGNORE)])
        segs = tuple(shard_segments(n, j, p.span, "zigzag") for j in range(p.span)) if p.span > 1 else ((0, n),)
        group = groups.groups.get(p.span)
        mine = segs[dist.get_rank(group)] if p.span > 1 else ((0, n),)  # ring order is the group's
        index = torch.cat([torch.arange(a, b, device=x.device) for a, b in mine])
        _append(rounds[p.round], x[index], y[index], index, p.span, segs, group)
    kept = int((labels != IGNORE).sum())
    return [_round(*r, device=inputs.device) for r in rounds], kept, work


def _append(rnd, x, y, positions, span, segs, group) -> None:
    tokens, labels, pos, pieces = rnd
    start = sum(t.numel() for t in tokens)
    pieces.append(Piece(start, start + x.numel(), group if span > 1 else None, segs))
    tokens.append(x)
    labels.append(y)
    pos.append(positions)


def _round(tokens, labels, positions, pieces, device):
    if not tokens:  # nothing placed here this round: one ignored token keeps the step uniform
        one = lambda v: torch.tensor([v], device=device)  # noqa: E731
        _append((tokens, labels, positions, pieces), one(PAD), one(IGNORE), one(0), 1, ((0, 1),), None)
    docs = DynamicDocuments(tuple(pieces), torch.cat(positions)[:, None])
    return torch.cat(tokens)[:, None], torch.cat(labels)[:, None], docs


def imbalance(work: list[float]) -> float:
    """Largest rank's attention work over the mean (1.0 = perfectly balanced)."""
    return max(work) / (sum(work) / len(work)) if sum(work) else 1.0
