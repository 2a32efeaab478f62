"""Weighted blends of datasets, as Megatron's ``--data-path 0.3 web 0.5 code 0.2 books``.

Sample ``n`` of the blended stream comes from the source whose realised count lags its share the
most: ``argmax_i  w_i * max(n, 1) - count_i`` (first source on ties), the rule and float64
arithmetic of megatron-core's ``build_blending_indices``, so the choices are the same sample for
sample. After ``n`` samples every source's count is within one sample of ``w_i * n``. The rule
is a pure function of ``n``: the batch of step ``s`` follows from ``s`` alone, under any layout, and
placing it starts from a sample shortly before it whose counts the rule forces (``anchor_counts``),
not from sample 0.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ..errors import UsageError
from .format import entropy


def normalised(weights) -> list[float]:
    """Weights over their sum, in float64 (megatron-core's ``utils.normalize``); weights whose sum
    overflows (``[1e308, 1e308]``) are scaled by their largest first, so the shares stay right."""
    w = np.asarray(weights, dtype=np.float64)
    with np.errstate(over="ignore"):
        total = w.sum()
    if not np.isfinite(total):
        w = w / w.max()
        total = w.sum()
    return (w / total).tolist()


def check_blend(blend, key: str) -> None:
    """``[[weight, prefix], ...]`` with weights > 0; else one line naming the entry."""
    if not isinstance(blend, (list, tuple)) or not blend:
        raise UsageError(f"{key} must be a list of [weight, prefix] pairs, e.g. [[0.7, \"web\"], [0.3, \"code\"]]")
    for entry in blend:
        ok = isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str) and entry[1]
        if not ok or isinstance(entry[0], bool) or not isinstance(entry[0], (int, float)):
            raise UsageError(f"{key} entry {entry!r} must be [weight, \"prefix\"], e.g. [0.3, \"data/web\"]")
        if not (math.isfinite(entry[0]) and entry[0] > 0):
            raise UsageError(f"{key} weight {entry[0]!r} of {entry[1]!r} must be a finite number > 0")
    prefixes = [e[1] for e in blend]
    dup = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if dup:
        raise UsageError(f"{key} names {dup[0]!r} twice; give it one weight")


def check_held_out(train: list, held_out: list, key: str) -> None:
    """One line if a held-out source (``key``) is also a training source: the eval would measure training data."""
    seen = {os.path.realpath(p): p for _, p in train}
    shared = [p for _, p in held_out if os.path.realpath(p) in seen]
    if shared:
        raise UsageError(f"{key} source {shared[0]!r} is also a training source, so the eval would measure the "
                         f"training data; give a held-out set, or leave {key} empty to hold out each training "
                         f"source's trailing [data].valid_fraction")


class BlendSchedule:
    """Which source each sample of the blended stream comes from, and its index within that source.

    Placing sample ``n`` needs the counts of the first ``n`` samples. They are not walked from 0:
    :func:`anchor_counts` finds, with numpy over blocks of samples just before ``n``, a sample whose
    counts the rule forces, and the walk starts there (a few samples back for a few sources, whatever
    ``n`` is). The schedule keeps its place, so consecutive steps cost at most their own samples.

    Limit: a forced sample needs about ``k - 1`` of the ``k`` sources' products just below an integer at
    once, so anchors thin out as ``k`` grows (many sources of generic weights may have none, while weights
    of a few decimals repeat and anchor at every period; tools/bench/results/from_source_comments.md).
    Without one within ANCHOR_SEARCH samples the walk starts from its current place or from 0, as it always did."""

    def __init__(self, weights):
        self.weights = normalised(weights)
        self._w = np.asarray(self.weights, dtype=np.float64)
        self._n, self._counts = 0, [0] * len(self.weights)

    def _advance(self, stop: int, record: list | None = None) -> None:
        w, c, k = self.weights, self._counts, len(self.weights)
        for n in range(self._n, stop):
            x = float(max(n, 1))
            best, lag = 0, w[0] * x - c[0]
            for i in range(1, k):
                e = w[i] * x - c[i]
                if e > lag:
                    best, lag = i, e
            if record is not None:
                record.append((best, c[best]))
            c[best] += 1
        self._n = max(self._n, stop)

    def _seek(self, n: int) -> None:
        """Place the walk at sample ``n``: from the last anchor at or before ``n``, or from where the walk is
        when that is nearer (consecutive steps of one rank: the search never looks further back)."""
        if n == self._n:
            return
        ahead = n > self._n
        found = anchor_counts(self._w, n, lowest=max(self._n + 1 if ahead else 2, n - ANCHOR_SEARCH))
        if found is not None:
            self._n, counts = found
            self._counts = [int(c) for c in counts]
        elif not ahead:
            self._n, self._counts = 0, [0] * len(self.weights)

    def counts_at(self, n: int) -> list[int]:
        """Samples taken from each source among the first ``n``."""
        self._seek(n)
        self._advance(n)
        return list(self._counts)

    def take(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, index within source)`` of samples ``start .. stop - 1``."""
        self.counts_at(start)
        record: list = []
        self._advance(stop, record)
        out = np.asarray(record, dtype=np.int64).reshape(-1, 2)
        return out[:, 0], out[:, 1]


ANCHOR_BLOCK = 1024  # samples searched per numpy block, going back from n
ANCHOR_SEARCH = 1 << 22  # samples searched at most, so a search stays short; further back, walking is the answer


def anchor_counts(w: np.ndarray, n: int, lowest: int = 2) -> tuple[int, np.ndarray] | None:
    """``(m, counts of the first m samples)`` for the last sample ``lowest <= m <= n`` whose counts the rule
    forces, or None.

    Source ``i`` was last taken (at some ``t < m``) when its lag ``P_i(t) - count_i`` was the largest, so
    at least the mean lag ``(sum_i P_i(t) - t) / k >= -eps``, where ``P_i(t) = w_i * max(t, 1)`` in float64
    is the product the rule compares and ``eps`` bounds float64's rounding of the products and of the
    weights' sum (a few ulps of ``t``). ``P_i`` never decreases, so ``count_i(m) <= U_i = floor(P_i(m - 1)
    + 1 + eps)``. The counts sum to ``m``: where the bounds do too, every count is its bound. The margin
    used for ``eps`` is far above float64's, which only makes the bounds looser (never wrong).

    The search costs numpy over the distance to the anchor, the walk from it Python over the same."""
    k = w.shape[0]
    hi, lowest = n + 1, max(lowest, 2)
    while hi > lowest:
        lo = max(lowest, hi - ANCHOR_BLOCK)
        m = np.arange(lo, hi, dtype=np.int64)
        before = w[None, :] * (m - 1).astype(np.float64)[:, None]  # P(m - 1), as the rule computes it
        margin = 64.0 * k * np.finfo(np.float64).eps * m.astype(np.float64)[:, None]
        bound = np.floor(before + 1.0 + margin).astype(np.int64)
        hits = np.flatnonzero(bound.sum(1) == m)
        if hits.size:
            j = int(hits[-1])
            return int(m[j]), bound[j]
        hi = lo
    return None


class Blend:
    """Datasets and their normalised weights, read as one training (or held-out) source."""

    def __init__(self, datasets: list, weights: list[float]):
        self.datasets, self.weights = list(datasets), normalised(weights)
        self.eos = self.datasets[0].eos
        known = [ds.vocab_size for ds in self.datasets if ds.vocab_size is not None]
        self.vocab_size = max(known) if known else None
        self.source = "blend(" + ", ".join(f"{w:.3g} {ds.source}" for w, ds in zip(self.weights, self.datasets)) + ")"

    @property
    def num_tokens(self) -> int:
        return sum(ds.num_tokens for ds in self.datasets)

    def unigram_entropy(self) -> float:
        """Entropy of the blend's token frequencies (each source's distribution weighted by its share)."""
        dists = [ds.token_counts() for ds in self.datasets]
        p = np.zeros(max(d.size for d in dists))
        for w, d in zip(self.weights, dists):
            p[: d.size] += w * d / d.sum()
        return entropy(p)


def check_same_vocabulary(datasets: list, key: str) -> None:
    """Every source of one run must share the vocabulary (where its header says it) and the EOS id."""
    first = datasets[0]
    for ds in datasets[1:]:
        if ds.eos != first.eos or None not in (ds.vocab_size, first.vocab_size) and ds.vocab_size != first.vocab_size:
            raise UsageError(f"{key}: dataset {ds.source} has vocab_size {ds.vocab_size}, EOS {ds.eos} but "
                             f"{first.source} has vocab_size {first.vocab_size}, EOS {first.eos}; tokenize every "
                             f"source with the same tokenizer")
