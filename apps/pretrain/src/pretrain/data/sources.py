"""Raw text for `pretrain prepare`, streamed: .txt, .jsonl, .jsonl.gz and .parquet files, or
directories of them, read a line (JSONL, text) or a record batch (Parquet) at a time, handed on in
batches of at most ``buffer_bytes`` of text. Memory is bounded by the buffer, not the corpus
(except ``--docs file``, where a text file is one document)."""

from __future__ import annotations

import gzip
import io
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import UsageError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
DOC_MODES = ("file", "paragraph", "line")


def kind(path: Path) -> str:
    name = path.name.lower()
    return next((s for s in SUFFIXES[1:] if name.endswith(s)), ".txt")


def input_files(paths: list[Path]) -> list[Path]:
    """The files named, with each directory replaced by the files of known suffix under it (sorted)."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise UsageError(f"input file(s) not found: {', '.join(missing)}")
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.lower().endswith(SUFFIXES))
            if not found:
                raise UsageError(f"directory {p} holds no {', '.join(SUFFIXES)} files")
            files += found
        else:
            files.append(p)
    return files


def _jsonl(path: Path, key: str) -> Iterator[str]:
    opener = gzip.open if kind(path) == ".jsonl.gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        yield from parse_jsonl(f, path, key)


def parse_jsonl(lines, path: Path, key: str, first: int = 1) -> Iterator[str]:
    """The ``key`` field of each JSON line of ``lines`` (numbered from ``first`` in messages)."""
    for number, line in enumerate(lines, first):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise UsageError(f"{path}:{number} is not a JSON object") from None
        except RecursionError:
            raise UsageError(f"{path}:{number} is nested too deeply to read (thousands of levels); a record is "
                             f"one JSON object with a string field \"{key}\"") from None
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise UsageError(f"{path}:{number} has no string field \"{key}\" (choose the field with --text-key)")
        if "\\ud" in line.lower():  # a \uD800-\uDFFF escape: a lone surrogate is no text (UTF-8 cannot hold it)
            _check_encodable(record[key], f"{path}:{number}", key)
        yield record[key]


@dataclass(frozen=True)
class RawLines:
    """Undecoded JSONL lines of ``path`` from line ``first`` on (``lines`` of them, ``data`` ends at a
    newline), for a worker to decode and parse: :meth:`texts`. Lines are counted as text mode reads
    them (universal newlines), so messages name the same line numbers as reading in one process."""

    path: Path
    key: str
    data: bytes
    first: int

    def texts(self) -> list[str]:
        try:
            text = self.data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"{self.path} is not UTF-8 text ({e.reason})") from None
        return list(parse_jsonl(io.StringIO(text, newline=None), self.path, self.key, self.first))

    @property
    def lines(self) -> int:
        """Lines in text mode: ends at \\n, \\r\\n or \\r (bytes no other UTF-8 character holds)."""
        d = self.data
        return d.count(b"\n") + d.count(b"\r") - d.count(b"\r\n") + (not d.endswith((b"\n", b"\r")))


def raw_jsonl(path: Path, key: str, buffer_bytes: int) -> Iterator[RawLines]:
    """``path``'s lines, undecoded, in blocks of about ``buffer_bytes`` ending at a newline."""
    opener = gzip.open if kind(path) == ".jsonl.gz" else open
    first, rest = 1, b""
    with opener(path, "rb") as f:
        while True:
            block = f.read(buffer_bytes)
            data = rest + block
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if cut == 0 and block:  # no newline yet: one line longer than the buffer
                rest = data
                continue
            chunk, rest = data[:cut], data[cut:]
            if chunk:
                raw = RawLines(path, key, chunk, first)
                first += raw.lines
                yield raw
            if not block:
                return


def _check_encodable(text: str, where: str, key: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where}: field \"{key}\" holds a lone surrogate {e.object[e.start:e.end]!r} (a \\uD800-"
                         f"\\uDFFF escape without its pair), which is not text; fix or drop that record") from None


def _parquet(path: Path, key: str, rows: int = 1024) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"reading {path} needs pyarrow; install it with `uv pip install 'pretrain[parquet]'`") from None
    try:
        table = pq.ParquetFile(path)
        if key not in table.schema_arrow.names:
            raise UsageError(f"{path} has no column \"{key}\" (its columns: {', '.join(table.schema_arrow.names)}; "
                             f"choose one with --text-key)")
        for number, batch in enumerate(table.iter_batches(batch_size=rows, columns=[key])):
            for i, text in enumerate(batch.column(0).to_pylist()):
                if not isinstance(text, str):
                    raise UsageError(f"{path}: row {number * rows + i} of column \"{key}\" is {type(text).__name__}, "
                                     f"not a string")
                yield text
    except UsageError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid / OSError for a corrupt or truncated file
        raise UsageError(f"{path} is not a readable Parquet file: {str(e).splitlines()[0]}") from None


def _text(path: Path, docs: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        if docs == "file":
            yield f.read()
        elif docs == "line":
            yield from (line.rstrip("\n") + "\n" for line in f if line.strip())
        else:
            paragraph: list[str] = []
            for line in f:
                if line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph).strip() + "\n"
                    paragraph = []
            if paragraph:
                yield "".join(paragraph).strip() + "\n"


def texts(path: Path, docs: str = "file", key: str = "text") -> Iterator[str]:
    """The documents of one input file: a JSONL line or Parquet row each, text files by ``docs``."""
    k = kind(path)
    try:
        if k == ".parquet":
            yield from _parquet(path, key)
        elif k in (".jsonl", ".jsonl.gz"):
            yield from _jsonl(path, key)
        else:
            yield from _text(path, docs)
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text ({e.reason})") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise UsageError(f"{path} is not a readable gzip file: {e}") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None


def batches(files: list[Path], docs: str, key: str, buffer_bytes: int) -> Iterator[list[str] | RawLines]:
    """Documents of all ``files`` in order, in lists of about ``buffer_bytes`` characters or fewer;
    JSONL as :class:`RawLines` of about ``buffer_bytes`` bytes, which the tokenizing worker parses."""
    batch, size = [], 0
    for path in files:
        if kind(path) in (".jsonl", ".jsonl.gz"):
            if batch:
                yield batch
                batch, size = [], 0
            try:
                yield from raw_jsonl(path, key, buffer_bytes)
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:
                raise UsageError(f"{path} is not a readable gzip file: {e}") from None
            except OSError as e:
                raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
            continue
        for text in texts(path, docs, key):
            batch.append(text)
            size += len(text)
            if size >= buffer_bytes:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch
