"""A deterministic, resumable sampler of packed sequences, sharded over data-parallel ranks.

The token stream is split once: the first ``1 - valid_fraction`` of the tokens train, the rest is
held out. Each split is cut into windows of ``seq_len + 1`` tokens (window w starts at w * seq_len,
so consecutive windows overlap by the one token that is both a label and the next input).

* Training: every epoch visits all windows in an order shuffled by (seed, epoch). Optimizer step s
  uses global sequences ``s * global_batch ... (s + 1) * global_batch - 1`` of that endless order;
  dp rank r takes the r-th contiguous ``global_batch / dp`` of them, cut into micro-batches, and reads
  only those (``global_*_batch`` read all of a step, for dynamic CP and tests). The
  batch is a pure function of the step: resuming at step s needs only s, and every tp/pp/cp rank
  of one dp rank gets the same tokens.
* Evaluation: held-out windows in order, batch i starting at window ``i * global_batch``. With a
  ``test_fraction`` (Megatron's ``--split``), each source's last ``test_fraction`` is a test part
  after the held-out one, read the same way.
* A blend (several datasets with weights, see ``blend.py``): global sample n comes from the source
  Megatron's blending rule picks, as that source's next sample; each source is split, shuffled
  (by seed, epoch and its place in the blend) and held out on its own. A separate eval set
  (``[data].eval_path``/``eval_blend``) replaces the held-out tails: training then uses every token.

A :class:`Batch` holds ``tokens [microbatches, micro_batch, seq_len + 1]`` (int64; inputs are
``[..., :-1]``, labels ``[..., 1:]``) and ``segments`` of the same shape (int32): the index of the
document each token belongs to, counted from 0 at the window's first token, so document boundaries
inside a packed sequence are where ``segments`` changes (for packed attention / cu_seqlens).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UsageError
from .blend import BlendSchedule
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


class Windows:
    """Windows of ``seq_len + 1`` tokens over ``dataset.tokens[lo:hi]``; window w starts at lo + w * seq_len.

    With a ``shuffle`` key, the i-th window taken is from an order shuffled per epoch by (key, epoch);
    without, windows come in order, wrapping around."""

    def __init__(self, dataset: TokenDataset, lo: int, hi: int, seq_len: int, shuffle: tuple | None):
        self.dataset, self.lo, self.seq_len, self.shuffle = dataset, lo, seq_len, shuffle
        self.count = max(0, (hi - lo - 1) // seq_len)
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([*self.shuffle[:1], epoch, *self.shuffle[1:]]).permutation(self.count)
            self._perm_epoch = epoch
        return self._perm

    def starts(self, indices: np.ndarray) -> np.ndarray:
        """Token offsets of the windows taken ``indices``-th."""
        if self.shuffle is None:
            return self.lo + (indices % self.count) * self.seq_len
        epochs, within = np.divmod(indices, self.count)
        starts = np.empty_like(indices)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            starts[sel] = self._order(int(epoch))[within[sel]]
        return self.lo + starts * self.seq_len


class Stream:
    """Samples of one or more :class:`Windows`, blended by weight (see ``blend.py``) when several.
    Thread-safe: the trainer reads the next step in the background (``prefetch.py``) while the
    main thread may log the blend's counts; the windows' and the blend's cached places are shared."""

    def __init__(self, windows: list[Windows], weights: list[float] | None):
        self.windows = windows
        self.blend = BlendSchedule(weights) if len(windows) > 1 else None
        self._lock = threading.Lock()

    def sources(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """For samples start..stop-1: the source of each and its index within that source."""
        if self.blend is None:
            return np.zeros(stop - start, dtype=np.int64), np.arange(start, stop, dtype=np.int64)
        with self._lock:
            return self.blend.take(start, stop)

    def counts_at(self, n: int) -> list[int]:
        """Samples each source gave among the first ``n`` (a blend's)."""
        with self._lock:
            return self.blend.counts_at(n)

    def gather(self, start: int, stop: int) -> Batch:
        with self._lock:
            return self._gather(start, stop)

    def _gather(self, start: int, stop: int) -> Batch:
        source, index = self.blend.take(start, stop) if self.blend is not None else self.sources(start, stop)
        seq_len = self.windows[0].seq_len
        tokens = np.empty((stop - start, seq_len + 1), dtype=np.int64)
        segments = np.empty((stop - start, seq_len + 1), dtype=np.int32)
        for k in np.unique(source):
            rows, w = source == k, self.windows[k]
            positions = w.starts(index[rows])[:, None] + np.arange(seq_len + 1)[None, :]
            tokens[rows] = np.asarray(w.dataset.tokens[positions.ravel()], dtype=np.int64).reshape(positions.shape)
            docs = np.searchsorted(w.dataset.doc_offsets, positions, side="right") - 1
            segments[rows] = docs - docs[:, :1]
        return Batch(torch.from_numpy(tokens), torch.from_numpy(segments))


class TokenSampler:
    """``dataset``: one :class:`TokenDataset` or a list of them blended by ``weights``. Each is split
    into its first ``1 - valid_fraction`` (training) and the rest (held out), unless ``eval_datasets``
    (with ``eval_weights``) give the held-out data: then training takes all of every dataset."""

    def __init__(self, dataset, *, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, valid_fraction: float = 0.05,
                 weights: list[float] | None = None, eval_datasets: list[TokenDataset] | None = None,
                 eval_weights: list[float] | None = None, test_fraction: float = 0.0):
        if global_batch % dp_size or (global_batch // dp_size) % micro_batch:
            raise UsageError(f"global_batch={global_batch} must split into dp={dp_size} x micro-batches of {micro_batch}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
        datasets = list(dataset) if isinstance(dataset, (list, tuple)) else [dataset]
        self.datasets, self.dataset = datasets, datasets[0]
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        blended = len(datasets) > 1
        # each source's first 1 - valid_fraction (- test_fraction) trains; all of it when the held-out set is separate
        splits = [ds.num_tokens if eval_datasets else int(round(ds.num_tokens * (1 - valid_fraction - test_fraction)))
                  for ds in datasets]
        train = [Windows(ds, 0, split, seq_len, (seed, k) if blended else (seed,))
                 for k, (ds, split) in enumerate(zip(datasets, splits))]
        # the test part: each source's last test_fraction, after the held-out part
        ends = [ds.num_tokens - int(round(ds.num_tokens * test_fraction)) for ds in datasets]
        if eval_datasets:
            valid = [Windows(ds, 0, ds.num_tokens, seq_len, None) for ds in eval_datasets]
        else:
            valid = [Windows(ds, split, end, seq_len, None) for ds, split, end in zip(datasets, splits, ends)]
        test = [Windows(ds, end, ds.num_tokens, seq_len, None) for ds, end in zip(datasets, ends)]
        for ds, w in zip(datasets, test if test_fraction else []):
            if w.count < 1:
                raise UsageError(f"dataset {ds.source} has {ds.num_tokens} tokens: too few for a test window "
                                 f"([data].split) of seq_len+1={seq_len + 1} tokens")
        held = "" if eval_datasets else f" and held-out (valid_fraction={valid_fraction})"
        for ds, t, v in zip(datasets, train, valid if not eval_datasets else train):
            if t.count < 1 or v.count < 1:
                raise UsageError(f"dataset {ds.source} has {ds.num_tokens} tokens: too few for training{held} windows "
                                 f"of seq_len+1={seq_len + 1} tokens")
        for ds, v in zip(eval_datasets or [], valid):
            if v.count < 1:
                raise UsageError(f"eval dataset {ds.source} is too small for one window of seq_len+1={seq_len + 1} tokens")
        self.split_at, self.train_windows, self.valid_windows = splits[0], train[0].count, valid[0].count
        # what the eval loss is measured on, in words for the eval log line (a tail is not a random sample)
        self.held_out = ("the separate eval set ([data].eval_path / eval_blend)" if eval_datasets else
                         f"{100 * valid_fraction:g} % of each source's tokens, before its test part ([data].split)"
                         if test_fraction else
                         f"the last {100 * valid_fraction:g} % of each source's tokens ([data].valid_fraction)")
        self.train = Stream(train, weights)
        self.valid = Stream(valid, eval_weights if eval_datasets else weights)
        self.test = Stream(test, weights) if test_fraction else None

    @property
    def eos(self) -> int | None:
        """The EOS id every source shares (``load_data`` refuses a blend whose sources differ)."""
        return self.dataset.eos

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.dp_size // self.micro_batch

    def source_samples(self, steps: int) -> list[int]:
        """Training samples each source gave in the first ``steps`` steps."""
        n = steps * self.global_batch
        return [n] if self.train.blend is None else self.train.counts_at(n)

    def shares(self, steps: int) -> dict:
        """For ``log.jsonl`` under a blend: each source's training samples in the first ``steps`` steps
        and its share of the tokens (every sample is ``seq_len`` tokens); {} for one dataset."""
        if self.train.blend is None:
            return {}
        counts = self.source_samples(steps)
        names = [ds.source for ds in self.datasets]
        total = max(sum(counts), 1)
        return {"data_samples": dict(zip(names, counts)), "data_share": {n: c / total for n, c in zip(names, counts)}}

    def _rank_part(self, stream: Stream, index: int) -> Batch:
        """This dp rank's contiguous ``global_batch / dp`` sequences of batch ``index``, read alone."""
        per_rank = self.global_batch // self.dp_size
        lo = index * self.global_batch + self.dp_rank * per_rank
        batch = stream.gather(lo, lo + per_rank)
        shape = (self.microbatches, self.micro_batch, self.seq_len + 1)
        return Batch(batch.tokens.reshape(shape), batch.segments.reshape(shape))

    def global_train_batch(self, step: int) -> Batch:
        """All ``global_batch`` sequences of optimizer step ``step`` (0-based): ``[global_batch, seq_len + 1]``."""
        return self.train.gather(step * self.global_batch, (step + 1) * self.global_batch)

    def global_eval_batch(self, index: int, split: str = "valid") -> Batch:
        stream = self.test if split == "test" else self.valid
        return stream.gather(index * self.global_batch, (index + 1) * self.global_batch)

    def train_batch(self, step: int) -> Batch:
        """This dp rank's part of step ``step``: ``[microbatches, micro_batch, seq_len + 1]``."""
        return self._rank_part(self.train, step)

    def eval_batch(self, index: int, split: str = "valid") -> Batch:
        """This dp rank's part of held-out (``split="test"``: test) batch ``index``: ``[microbatches, micro_batch,
        seq_len + 1]``."""
        return self._rank_part(self.test if split == "test" else self.valid, index)
