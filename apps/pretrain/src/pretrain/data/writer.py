"""Writing a token dataset, ours (``format.py``) or Megatron's (``megatron_format.py``), a batch at a time.

Token ids stream to ``PREFIX.bin`` as they come (memory: one batch, plus 8 bytes per document for
the index). Everything is written under fresh temporary names (created exclusively) and renamed once the last document is in,
the header last, so a failing input leaves an existing dataset at ``PREFIX`` untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..runtime.safe_files import fresh_temp
from . import megatron_format
from .format import FORMAT, VERSION, TokenDataset, open_dataset, token_dtype

FORMATS = ("par", "megatron")


class DatasetWriter:
    def __init__(self, prefix: str | Path, vocab_size: int, tokenizer: str = "byte", eos: int | None = None,
                 format: str = "par", tokenizer_sha256: str | None = None):

        if format not in FORMATS:
            raise UsageError(f"--format {format!r} is not one of {', '.join(FORMATS)}")
        prefix = Path(prefix)
        if not prefix.name or prefix.is_dir():
            raise UsageError(f"{str(prefix)!r} is a directory; give a file prefix inside it, e.g. {prefix / 'corpus'}")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self.prefix, self.vocab_size, self.tokenizer, self.eos, self.format = prefix, vocab_size, tokenizer, eos, format
        self.tokenizer_sha256 = tokenizer_sha256
        self.dtype = token_dtype(vocab_size) if format == "par" else megatron_format.megatron_dtype(vocab_size)
        self.final = {ext: Path(f"{prefix}.{ext}") for ext in ("bin", "idx", "json")}
        self.tmp: dict[str, Path] = {}
        try:  # fresh names, never a fixed one: a symlink planted there is not written through
            for ext, p in self.final.items():
                self.tmp[ext] = fresh_temp(p)
            self._bin = open(self.tmp["bin"], "wb")
        except BaseException:
            self._remove_temporaries()
            raise
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self.counts = np.zeros(1, dtype=np.int64)  # of each id, for the unigram entropy without re-reading

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as their ids back to back (``ids``) and their ``lengths`` (zeros are skipped)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids.max() if ids.max() >= self.vocab_size else ids.min()
            raise UsageError(f"token id {int(bad)} is outside the vocabulary of {self.vocab_size}")
        self._bin.write(ids.astype(self.dtype).tobytes())
        part = np.bincount(ids)
        self.counts = np.pad(self.counts, (0, max(0, part.size - self.counts.size)))
        self.counts[: part.size] += part
        lengths = np.asarray(lengths, dtype=np.int64)
        self._lengths.append(lengths[lengths > 0])
        self.num_tokens += int(ids.size)

    def close(self):
        """Write the index and header, rename everything into place, return the opened dataset."""

        try:
            self._bin.close()
            if self.num_tokens == 0:
                raise UsageError("the inputs contain no text to tokenize")
            lengths = np.concatenate(self._lengths)
            if self.format == "megatron":
                megatron_format.write_index(self.tmp["idx"], lengths, self.dtype)
                megatron_format.write_sidecar(self.tmp["json"], self.vocab_size, self.tokenizer, self.eos,
                                              self.num_tokens, lengths.size, self.tokenizer_sha256)
            else:
                np.concatenate([[0], np.cumsum(lengths)]).astype("<i8").tofile(self.tmp["idx"])
                header = dict(format=FORMAT, version=VERSION, dtype=self.dtype.name, vocab_size=int(self.vocab_size),
                              num_tokens=self.num_tokens, num_docs=int(lengths.size), tokenizer=self.tokenizer)
                if self.eos is not None:
                    header["eos"] = int(self.eos)
                if self.tokenizer_sha256:
                    header["tokenizer_sha256"] = self.tokenizer_sha256
                self.tmp["json"].write_text(json.dumps(header, indent=1) + "\n")
            for ext in ("bin", "idx", "json"):  # the header last: a reader never sees a header without its data
                self.tmp[ext].replace(self.final[ext])
        finally:
            self.abort()
        return open_dataset(self.prefix)

    def abort(self) -> None:
        """Remove the temporary files (an existing dataset at the prefix stays as it was)."""
        self._bin.close()
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for p in self.tmp.values():
            p.unlink(missing_ok=True)


def write_dataset(prefix: str | Path, docs, vocab_size: int, tokenizer: str = "byte", eos: int | None = None,
                  format: str = "par") -> TokenDataset:
    """Write an iterable of token-id sequences (one per document) as PREFIX.bin/.idx/.json (``format``:
    par or megatron, see ``writer.py``), each followed by ``eos`` when given (recorded in the header)."""
    writer = DatasetWriter(prefix, vocab_size, tokenizer, eos, format)
    try:
        for doc in docs:
            ids = np.asarray(doc, dtype=np.int64)
            if ids.size:
                ids = np.append(ids, eos) if eos is not None else ids
                writer.add(ids, np.array([ids.size]))
    except BaseException:
        writer.abort()
        raise
    return writer.close()
