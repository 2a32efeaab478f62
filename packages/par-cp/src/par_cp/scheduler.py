"""Dynamic CP for packed variable-length samples (Megatron's --hybrid-context-parallel).

Given the token capacity of one rank (``max_seqlen_per_rank``) and the lengths of the
sub-samples of a batch, choose for each sub-sample how many ranks it spans and which ones:

- span = the smallest power of two with ``ceil(length / span) <= max_seqlen_per_rank``, so a
  sub-sample that fits on one rank stays on one rank, a long one spreads just enough;
- the ranks are an aligned block of ``span`` consecutive ranks (the blocks nest like CP
  subgroups, so each span size needs one set of process groups);
- longest first, each sub-sample goes to the least-loaded block that still has room, in the
  first round (micro-step) where one has room; a new round opens when none has. The load is
  tokens (``balance="tokens"``) or causal attention work (``"compute"``: a sub-sample of length L
  over s ranks costs each ~L^2 / (2 s), so long ones weigh what they cost).

No rank ever holds more than ``max_seqlen_per_rank`` tokens in a round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class DocumentSpan:
    index: int  # position of the sub-sample in the input
    length: int
    span: int  # CP ranks it is spread over
    ranks: tuple[int, ...]
    round: int

    @property
    def tokens_per_rank(self) -> int:
        return math.ceil(self.length / self.span)


@dataclass(frozen=True)
class CPSchedule:
    num_ranks: int
    max_seqlen_per_rank: int
    spans: tuple[DocumentSpan, ...]  # in input order

    @property
    def num_rounds(self) -> int:
        return 1 + max((p.round for p in self.spans), default=-1)

    def loads(self, round: int = 0) -> list[int]:
        """Tokens each rank holds in ``round``."""
        out = [0] * self.num_ranks
        for p in self.spans:
            if p.round == round:
                for r in p.ranks:
                    out[r] += p.tokens_per_rank
        return out


def span_for(length: int, max_seqlen_per_rank: int) -> int:
    """Smallest power-of-two number of ranks that holds ``length`` tokens."""
    span = 1
    while math.ceil(length / span) > max_seqlen_per_rank:
        span *= 2
    return span


def attention_work(length: int, span: int) -> float:
    """Query-key pairs one of ``span`` ranks computes for a causal sub-sample of ``length`` tokens."""
    return length * (length + 1) / 2 / span


def schedule_subsamples(lengths: Sequence[int], max_seqlen_per_rank: int, num_ranks: int,
                        balance: str = "tokens") -> CPSchedule:
    if balance not in ("tokens", "compute"):
        raise ValueError(f"balance={balance!r} is not 'tokens' or 'compute'")
    if max_seqlen_per_rank < 1 or num_ranks < 1:
        raise ValueError(f"max_seqlen_per_rank={max_seqlen_per_rank} and num_ranks={num_ranks} must be positive")
    if any(n < 1 for n in lengths):
        raise ValueError(f"sub-sample lengths must be positive, got {list(lengths)}")
    loads: list[list[int]] = []  # per round, tokens per rank
    work: list[list[float]] = []  # per round, what the blocks are balanced by
    placed: dict[int, DocumentSpan] = {}
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        length = int(lengths[i])
        span = span_for(length, max_seqlen_per_rank)
        if span > num_ranks:
            raise ValueError(
                f"sub-sample {i} of length {length} needs {span} ranks of {max_seqlen_per_rank} tokens, "
                f"but there are only {num_ranks}; raise max_seqlen_per_rank or the number of ranks"
            )
        share = math.ceil(length / span)
        cost = share if balance == "tokens" else attention_work(length, span)
        blocks = [tuple(range(s, s + span)) for s in range(0, num_ranks - span + 1, span)]
        choice = None
        for rnd, load in enumerate(loads):
            fits = [b for b in blocks if all(load[r] + share <= max_seqlen_per_rank for r in b)]
            if fits:
                choice = rnd, min(fits, key=lambda b: (max(work[rnd][r] for r in b), b))
                break
        if choice is None:
            loads.append([0] * num_ranks)
            work.append([0.0] * num_ranks)
            choice = len(loads) - 1, blocks[0]
        rnd, block = choice
        for r in block:
            loads[rnd][r] += share
            work[rnd][r] += cost
        placed[i] = DocumentSpan(i, length, span, block, rnd)
    return CPSchedule(num_ranks, max_seqlen_per_rank, tuple(placed[i] for i in range(len(lengths))))
