"""The token dataset on disk: three files that share a prefix, memory-mapped, nothing unpickled.

::

    PREFIX.bin   all token ids, documents back to back, each ending with the tokenizer's EOS id
                 (files from before EOS, or written with ``--no-eos``, have no separator),
                 little-endian uint16 when vocab_size <= 65536, else uint32
    PREFIX.idx   num_docs + 1 little-endian int64 offsets into PREFIX.bin: document d is
                 tokens[idx[d]:idx[d+1]]; idx[0] = 0 and idx[-1] = num_tokens
    PREFIX.json  header: {"format": "par-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
                 "num_tokens": N, "num_docs": D, "tokenizer": "byte", "eos": 256}
                 ``eos`` (optional: absent or null in files without a separator) is the id that
                 ends every document; Megatron-style document masking needs it.

``pretrain prepare INPUT... --out PREFIX`` writes them (``writer.py``); ``[data].path = "PREFIX"`` trains
on them. :func:`open_dataset` also reads Megatron-LM's ``.bin``/``.idx`` (``megatron_format.py``), told
apart by the ``.idx``'s first bytes (Megatron's magic; ours starts with the offset 0).
Training samples are windows of seq_len + 1 tokens taken from the concatenated stream, so a
sequence packs several documents; the offsets tell where each one starts (see ``sampler.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from . import megatron_format

FORMAT = "par-tokens"
VERSION = 1
HEADER_KEYS = ("format", "version", "dtype", "vocab_size", "num_tokens", "num_docs", "tokenizer")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True, eq=False)
class TokenDataset:
    """Token ids (1-D, possibly a read-only memmap) and document offsets ``[num_docs + 1]``."""

    tokens: np.ndarray
    doc_offsets: np.ndarray
    vocab_size: int | None  # None: the files do not say (Megatron's own); ids are checked against the model
    tokenizer: str = "byte"
    source: str = "<embedded>"
    eos: int | None = None  # the id ending every document, None: documents have no separator
    format: str = "par"  # par | megatron (see megatron_format.py)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_offsets.shape[0]) - 1

    def unigram_entropy(self) -> float:
        """Entropy of the token frequencies, in nats (the loss a model ignoring all context reaches)."""
        return entropy(self.token_counts())

    def token_counts(self, chunk: int = 1 << 24) -> np.ndarray:
        """How often each id occurs (``[max id + 1]``)."""
        counts = np.zeros(1, dtype=np.int64)
        for start in range(0, self.num_tokens, chunk):
            part = np.asarray(self.tokens[start:start + chunk])
            part = np.bincount(part.clip(0) if part.dtype.kind == "i" else part)
            counts = np.pad(counts, (0, max(0, part.size - counts.size)))
            counts[: part.size] += part
        return counts


def entropy(counts: np.ndarray) -> float:
    """Entropy in nats of the distribution ``counts`` are samples of."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def check_token_ids(ds: TokenDataset, vocab_size: int, chunk: int = 1 << 24) -> None:
    """UsageError naming the first token id >= ``vocab_size`` or < 0 (they would index past the embedding)."""
    info = np.iinfo(ds.tokens.dtype)
    if info.max < vocab_size and info.min == 0:
        return
    for start in range(0, ds.num_tokens, chunk):
        part = np.asarray(ds.tokens[start:start + chunk])
        bad = np.flatnonzero((part >= vocab_size) | (part < 0))
        if bad.size:
            at = start + int(bad[0])
            raise UsageError(f"dataset {ds.source}: token id {int(part[bad[0]])} at offset {at} is outside the "
                             f"vocabulary of {vocab_size}; re-run `pretrain prepare` with the model's tokenizer")


def _strip_suffix(prefix: str) -> str:
    for suffix in (".json", ".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def open_dataset(prefix: str | Path) -> TokenDataset:
    """Memory-map a dataset, ours or Megatron's (told apart by the ``.idx``'s first bytes: Megatron's
    magic, or our first offset 0); any missing or malformed part is a UsageError naming the file."""
    prefix = _strip_suffix(str(prefix))
    paths = {ext: Path(f"{prefix}.{ext}") for ext in ("json", "bin", "idx")}
    missing = [str(paths[e]) for e in ("bin", "idx") if not paths[e].is_file()]
    if missing:
        raise UsageError(f"dataset {prefix!r} is missing {', '.join(missing)}; write it with `pretrain prepare`")
    try:
        with open(paths["idx"], "rb") as f:
            head = f.read(len(megatron_format.MAGIC))
    except OSError as e:
        raise UsageError(f"cannot read {paths['idx']}: {e.strerror}") from None
    if head == megatron_format.MAGIC:
        return _open_megatron(prefix)
    if head[:8] != bytes(8):
        raise UsageError(f"{paths['idx']} starts with {head!r}: neither Megatron's MMIDIDX magic nor a {FORMAT} "
                         f"index (int64 offsets from 0)")
    if not paths["json"].is_file():
        raise UsageError(f"dataset {prefix!r} is missing {paths['json']}; write it with `pretrain prepare`")
    try:
        header = json.loads(paths["json"].read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"dataset header {paths['json']} is not valid JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise UsageError(f"{paths['json']} is not a {FORMAT} v{VERSION} header")
    absent = [k for k in HEADER_KEYS if k not in header]
    if absent:
        raise UsageError(f"dataset header {paths['json']} lacks {', '.join(absent)}")
    if header["dtype"] not in ("uint16", "uint32") or not isinstance(header["dtype"], str):
        raise UsageError(f"dataset header {paths['json']} has dtype {header['dtype']!r}; expected uint16 or uint32")
    wrong = [f"{k}={header[k]!r}" for k in ("vocab_size", "num_tokens", "num_docs")
             if type(header[k]) is not int or header[k] < 0]
    wrong += [] if isinstance(header["tokenizer"], str) else [f"tokenizer={header['tokenizer']!r}"]
    eos = header.get("eos")
    if eos is not None and not (type(eos) is int and type(header["vocab_size"]) is int and 0 <= eos < header["vocab_size"]):
        wrong.append(f"eos={eos!r}")
    if wrong:
        raise UsageError(f"dataset header {paths['json']} has {', '.join(wrong)}; expected non-negative integers "
                         f"(eos below vocab_size, or null) and a tokenizer name")
    dtype = np.dtype("<u2" if header["dtype"] == "uint16" else "<u4")
    n, d = header["num_tokens"], header["num_docs"]
    if paths["bin"].stat().st_size != n * dtype.itemsize:
        raise UsageError(f"{paths['bin']} has {paths['bin'].stat().st_size} bytes; the header says {n} tokens of "
                         f"{header['dtype']} ({n * dtype.itemsize} bytes)")
    if paths["idx"].stat().st_size != (d + 1) * 8:
        raise UsageError(f"{paths['idx']} has {paths['idx'].stat().st_size} bytes; the header says {d} documents "
                         f"({(d + 1) * 8} bytes of int64 offsets)")
    if n == 0:
        raise UsageError(f"dataset {prefix!r} has no tokens")
    offsets = np.fromfile(paths["idx"], dtype="<i8")
    if offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) <= 0):
        raise UsageError(f"{paths['idx']} offsets must rise strictly from 0 to num_tokens={n}")
    tokens = np.memmap(paths["bin"], dtype=dtype, mode="r", shape=(n,))
    return TokenDataset(tokens=tokens, doc_offsets=offsets, vocab_size=int(header["vocab_size"]),
                        tokenizer=str(header["tokenizer"]), source=prefix, eos=eos)


def _open_megatron(prefix: str) -> TokenDataset:
    tokens, offsets, header = megatron_format.read_megatron(prefix)
    if tokens.shape[0] == 0:
        raise UsageError(f"dataset {prefix!r} has no tokens")
    return TokenDataset(tokens=tokens, doc_offsets=offsets, vocab_size=header.get("vocab_size"),
                        tokenizer=str(header.get("tokenizer", "unknown")), source=prefix, eos=header.get("eos"),
                        format="megatron")
