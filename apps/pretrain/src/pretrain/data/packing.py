"""Documents packed into one training sequence, as Megatron's --reset-attention-mask,
--reset-position-ids and --eod-mask-loss treat them.

The sampler's ``segments`` say which document each token belongs to (documents end with EOS, so
a new one starts right after each EOS). From them, per micro-batch:

* ``cu_seqlens``: the document boundaries of each sequence (varlen: every sequence has its own),
  which keep attention inside a document;
* ``positions``: RoPE positions counted from 0 at each document's first token;
* the loss mask: the prediction made at an EOS (the next document's first token, which nothing
  in the finished document can foretell) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # the label of a dropped prediction (par_tp.vocab_parallel_cross_entropy's ignore_index)


@dataclass(frozen=True)
class Documents:
    """One micro-batch's documents as this CP rank's attention sees them."""

    cu_seqlens: tuple[tuple[int, ...], ...] | None  # per sequence, of the full sequence; None: no mask
    positions: torch.Tensor | None  # [S/cp, B] RoPE positions of this rank's tokens; None: 0..S-1


def document_starts(segments: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: True at the first token of each document (and at position 0)."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return starts


def cu_seqlens(segments: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Per sequence of ``segments [B, S]``: 0, the start of every later document, S."""
    s = segments.shape[1]
    return tuple(tuple(row.nonzero().flatten().tolist()) + (s,) for row in document_starts(segments))


def positions_within_documents(segments: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: each token's distance from its document's first token in the sequence."""
    index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    start = torch.where(document_starts(segments), index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start


def mask_eod_labels(inputs: torch.Tensor, labels: torch.Tensor, eos: int) -> torch.Tensor:
    """``labels`` with the prediction made at every EOS input set to :data:`IGNORE`."""
    return labels.masked_fill(inputs == eos, IGNORE)
