"""A deterministic, resumable sampler of packed sequences, sharded over data-parallel ranks.

The token stream is split once: the first ``1 - valid_fraction`` of the tokens train, the rest is
held out. Each split is cut into windows of ``seq_len + 1`` tokens (window w starts at w * seq_len,
so consecutive windows overlap by the one token that is both a label and the next input).

* Training: every epoch visits all windows in an order shuffled by (seed, epoch). Optimizer step s
  uses global sequences ``s * global_batch ... (s + 1) * global_batch - 1`` of that endless order;
  dp rank r takes the r-th contiguous ``global_batch / dp`` of them, cut into micro-batches. The
  batch is a pure function of the step: resuming at step s needs only s, and every tp/pp/cp rank
  of one dp rank gets the same tokens.
* Evaluation: held-out windows in order, batch i starting at window ``i * global_batch``.

A :class:`Batch` holds ``tokens [microbatches, micro_batch, seq_len + 1]`` (int64; inputs are
``[..., :-1]``, labels ``[..., 1:]``) and ``segments`` of the same shape (int32): the index of the
document each token belongs to, counted from 0 at the window's first token, so document boundaries
inside a packed sequence are where ``segments`` changes (for packed attention / cu_seqlens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UsageError
from .format import TokenDataset


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [..., seq_len + 1] int64
    segments: torch.Tensor  # [..., seq_len + 1] int32, document index within each sequence

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[..., :-1]

    @property
    def labels(self) -> torch.Tensor:
        return self.tokens[..., 1:]

    @property
    def input_segments(self) -> torch.Tensor:
        return self.segments[..., :-1]


class TokenSampler:
    def __init__(self, dataset: TokenDataset, *, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, valid_fraction: float = 0.05):
        if global_batch % dp_size or (global_batch // dp_size) % micro_batch:
            raise UsageError(f"global_batch={global_batch} must split into dp={dp_size} x micro-batches of {micro_batch}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
        self.dataset = dataset
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        n = dataset.num_tokens
        self.split_at = int(round(n * (1 - valid_fraction)))
        self.train_windows = (self.split_at - 1) // seq_len
        self.valid_windows = (n - self.split_at - 1) // seq_len
        if self.train_windows < 1 or self.valid_windows < 1:
            raise UsageError(f"dataset {dataset.source} has {n} tokens: too few for training and held-out windows of "
                             f"seq_len+1={seq_len + 1} tokens (valid_fraction={valid_fraction})")
        self._perm_epoch, self._perm = -1, None

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.dp_size // self.micro_batch

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.train_windows)
            self._perm_epoch = epoch
        return self._perm

    def _train_starts(self, indices: np.ndarray) -> np.ndarray:
        epochs, within = np.divmod(indices, self.train_windows)
        starts = np.empty_like(indices)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            starts[sel] = self._order(int(epoch))[within[sel]]
        return starts * self.seq_len

    def _gather(self, starts: np.ndarray) -> Batch:
        positions = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        tokens = np.asarray(self.dataset.tokens[positions.ravel()], dtype=np.int64).reshape(positions.shape)
        docs = np.searchsorted(self.dataset.doc_offsets, positions, side="right") - 1
        segments = (docs - docs[:, :1]).astype(np.int32)
        return Batch(torch.from_numpy(tokens), torch.from_numpy(segments))

    def _rank_slice(self, batch: Batch) -> Batch:
        per_rank = self.global_batch // self.dp_size
        lo = self.dp_rank * per_rank
        shape = (self.microbatches, self.micro_batch, self.seq_len + 1)
        return Batch(batch.tokens[lo:lo + per_rank].reshape(shape).contiguous(),
                     batch.segments[lo:lo + per_rank].reshape(shape).contiguous())

    def global_train_batch(self, step: int) -> Batch:
        """All ``global_batch`` sequences of optimizer step ``step`` (0-based): ``[global_batch, seq_len + 1]``."""
        indices = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        return self._gather(self._train_starts(indices))

    def global_eval_batch(self, index: int) -> Batch:
        windows = (index * self.global_batch + np.arange(self.global_batch, dtype=np.int64)) % self.valid_windows
        return self._gather(self.split_at + windows * self.seq_len)

    def train_batch(self, step: int) -> Batch:
        """This dp rank's part of step ``step``: ``[microbatches, micro_batch, seq_len + 1]``."""
        return self._rank_slice(self.global_train_batch(step))

    def eval_batch(self, index: int) -> Batch:
        """This dp rank's part of held-out batch ``index``: ``[microbatches, micro_batch, seq_len + 1]``."""
        return self._rank_slice(self.global_eval_batch(index))
