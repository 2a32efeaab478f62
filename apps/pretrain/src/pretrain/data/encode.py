"""Tokenizing batches of documents, in this process or in ``workers`` processes, in input order.

A batch is a list of documents or a block of undecoded JSONL lines (``sources.RawLines``), which
the worker decodes and parses itself, so the parent only reads bytes. Each batch is one call of
the tokenizer's ``encode_batch`` (a Hugging Face tokenizer's own Rust parallelism: the worker
processes share the cores between them).

At most ``2 * workers`` batches are in flight (read ahead, being tokenized, or waiting to be
written), so memory stays a few buffers whatever the corpus size, and the output is the same
bytes for any number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from itertools import chain
from typing import Iterable, Iterator

import numpy as np

from ..runtime.cpus import cores  # noqa: F401 - ``--workers``' default, imported from here
from .sources import RawLines
from .tokenizer import get_tokenizer

_worker_tokenizer = None  # the tokenizer of a worker process (set by its initializer; never in the parent)


def encode(tok, texts: list[str] | RawLines, eos: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """``(ids back to back, one length per document, utf-8 bytes of text)`` with ``eos`` after each document."""
    if isinstance(texts, RawLines):
        texts = texts.texts()
    encoded = tok.encode_batch(texts)
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    if encoded and isinstance(encoded[0], bytes):  # the byte tokenizer: the ids are the bytes
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int64)
        nbytes = flat.size
    else:
        flat = np.fromiter(chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
    if eos is not None:
        keep = lengths > 0  # an empty document gets no EOS either
        flat = np.insert(flat, np.cumsum(lengths)[keep], eos)
        lengths = lengths + keep
    return flat, lengths, nbytes


def _init_worker(spec: str | None) -> None:
    global _worker_tokenizer
    for s in (signal.SIGTERM, signal.SIGINT):  # a forked worker keeps no handler of the parent's: the pool ends it
        signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.SIG_IGN)
    _worker_tokenizer = get_tokenizer(spec)


def _encode_in_worker(texts: list[str], eos: int | None):
    return encode(_worker_tokenizer, texts, eos)


def encoded_batches(batches: Iterable[list[str]], tok, spec: str | None, eos: int | None,
                    workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """:func:`encode` of each batch, in order; ``workers > 1`` tokenizes in that many processes."""
    if workers <= 1:
        for texts in batches:
            yield encode(tok, texts, eos)
        return
    threads = cores() // workers  # the tokenizer's Rust threads per worker: the workers share the cores
    if threads <= 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    else:
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    # Never a fork of this process: its other threads (a tokenizer's, pyarrow's, a caller's) may hold a
    # lock at that moment, and a child stuck on it neither answers nor dies of the pool's SIGTERM. Nor
    # the forkserver: it is one per process and keeps the preload of whoever starts it, so starting it
    # here (without torch) would make every training rank the process forks later import torch itself.
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(spec,))
    try:
        pending: deque = deque()
        for texts in batches:
            pending.append(pool.apply_async(_encode_in_worker, (texts, eos)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()  # the workers finish and exit
    finally:
        pool.terminate()  # on an error: at once
        pool.join()
