"""Megatron-LM's indexed dataset (``tools/preprocess_data.py``, megatron-core's ``IndexedDataset``),
read memory-mapped and written, nothing unpickled.

::

    PREFIX.bin   token ids of every sequence back to back, in the dtype the index names
    PREFIX.idx   b"MMIDIDX\\x00\\x00"             9 bytes
                 version               <u8       1
                 dtype code            <u1       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
                 sequence count S      <u8
                 document count D + 1  <u8
                 sequence lengths      <i4 [S]   tokens per sequence
                 sequence pointers     <i8 [S]   byte offset of each sequence in PREFIX.bin
                 document indices      <i8 [D+1] document d is sequences [doc[d], doc[d+1])
                 (sequence modes       <i1 [S]   multimodal datasets only; ignored)

Megatron's files do not say the vocabulary or the EOS id. ``pretrain prepare --format megatron``
adds ``PREFIX.json`` (``{"format": "megatron-mmidx", "vocab_size", "eos", "tokenizer"}``, which
Megatron ignores); without it the vocabulary is checked against ``[model].vocab_size`` token by
token and ``[data].eos`` names the EOS id.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import UsageError

MAGIC = b"MMIDIDX\x00\x00"
SIDECAR = "megatron-mmidx"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # token ids only: no floats
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8


def megatron_dtype(vocab_size: int) -> np.dtype:
    """Megatron's ``DType.optimal_dtype``: uint16 below 65500 ids, else int32."""
    return np.dtype("<u2") if vocab_size < 65500 else np.dtype("<i4")


def dtype_code(dtype: np.dtype) -> int:
    return next(code for code, t in DTYPES.items() if np.dtype(t) == np.dtype(dtype))


def write_index(path: Path, lengths: np.ndarray, dtype: np.dtype) -> None:
    """The ``.idx`` of one sequence per document (what preprocess_data writes without sentence splitting)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise UsageError(f"a document of {int(lengths.max())} tokens does not fit Megatron's int32 sequence lengths")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", lengths.size) + struct.pack("<Q", lengths.size + 1))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(lengths.size + 1, dtype="<i8").tobytes())


def write_sidecar(path: Path, vocab_size: int, tokenizer: str, eos: int | None, num_tokens: int, num_docs: int,
                  tokenizer_sha256: str | None = None) -> None:
    header = dict(format=SIDECAR, vocab_size=int(vocab_size), tokenizer=tokenizer, eos=eos,
                  num_tokens=int(num_tokens), num_docs=int(num_docs))
    if tokenizer_sha256:
        header["tokenizer_sha256"] = tokenizer_sha256
    path.write_text(json.dumps(header, indent=1) + "\n")


def is_megatron(idx_path: Path) -> bool:
    with open(idx_path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _sidecar(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        header = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"dataset header {path} is not valid JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != SIDECAR:
        raise UsageError(f"{path} is not a {SIDECAR} header (next to a Megatron .idx; delete it to read the "
                         f".bin/.idx alone)")
    vocab, eos = header.get("vocab_size"), header.get("eos")
    if type(vocab) is not int or vocab < 1 or not (eos is None or (type(eos) is int and 0 <= eos < vocab)):
        raise UsageError(f"dataset header {path} has vocab_size={vocab!r}, eos={eos!r}; expected a positive "
                         f"vocab_size and an eos below it (or null)")
    return header


def read_megatron(prefix: str):
    """``(tokens memmap, document token offsets, dtype, sidecar header)`` of a Megatron prefix."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    size = idx.stat().st_size
    if size < HEADER_BYTES:
        raise UsageError(f"{idx} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte MMIDIDX header")
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    version, = struct.unpack_from("<Q", head, 9)
    code, = struct.unpack_from("<B", head, 17)
    seqs, docs = struct.unpack_from("<QQ", head, 18)
    if version != 1:
        raise UsageError(f"{idx} is MMIDIDX version {version}; only version 1 exists")
    if code not in DTYPES:
        raise UsageError(f"{idx} has dtype code {code}; token ids need one of {sorted(DTYPES)} "
                         f"(1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)")
    need = HEADER_BYTES + 12 * seqs + 8 * docs
    if size not in (need, need + seqs) or docs < 2 or seqs < 1:
        raise UsageError(f"{idx} has {size} bytes; its header ({seqs} sequences, {docs} document indices) needs "
                         f"{need} (or {need + seqs} with sequence modes)")
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    lengths = np.memmap(idx, dtype="<i4", mode="r", offset=HEADER_BYTES, shape=(seqs,)).astype(np.int64)
    pointers = np.memmap(idx, dtype="<i8", mode="r", offset=HEADER_BYTES + 4 * seqs, shape=(seqs,))
    doc_index = np.array(np.memmap(idx, dtype="<i8", mode="r", offset=HEADER_BYTES + 12 * seqs, shape=(docs,)))
    ends = pointers + lengths * dtype.itemsize
    bin_bytes = bin_.stat().st_size
    if lengths.min() < 0 or pointers.min() < 0:
        raise UsageError(f"{idx} has a negative sequence length or pointer; it is not a valid MMIDIDX index")
    if ends.max() > bin_bytes:
        at = int(np.argmax(ends > bin_bytes))
        raise UsageError(f"{idx}: sequence {at} (pointer {int(pointers[at])}, {int(lengths[at])} tokens of {dtype.name}) "
                         f"runs past {bin_} ({bin_bytes} bytes); the .bin is truncated or belongs to another index")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * dtype.itemsize
    if not np.array_equal(pointers, starts) or int(ends[-1]) != bin_bytes:
        raise UsageError(f"{idx}: the sequences are not stored back to back in {bin_} ({bin_bytes} bytes, the index "
                         f"covers {int(ends[-1])}); rebuild it with Megatron's tools/merge_datasets.py or "
                         f"`pretrain prepare --format megatron`")
    if doc_index[0] != 0 or doc_index[-1] != seqs or np.any(np.diff(doc_index) < 0):
        raise UsageError(f"{idx}: document indices must rise from 0 to the sequence count {seqs}")
    token_offsets = np.concatenate([[0], np.cumsum(lengths)])
    doc_offsets = np.unique(token_offsets[doc_index])  # empty documents (no sequence, or empty ones) dropped
    tokens = np.memmap(bin_, dtype=dtype, mode="r", shape=(int(token_offsets[-1]),))
    return tokens, doc_offsets.astype(np.int64), _sidecar(Path(f"{prefix}.json"))
