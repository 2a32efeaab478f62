"""`pretrain prepare`: tokenize raw text (.txt, .jsonl[.gz], .parquet, directories of them) into a
memory-mapped dataset, ours or Megatron's (see pretrain.data.format / megatron_format), streamed."""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import List, Optional

import typer

from ..data import ByteTokenizer, get_tokenizer, open_dataset
from ..data.format import entropy
from ..data.encode import cores, encoded_batches
from ..data.sources import DOC_MODES, batches, input_files
from ..data.writer import FORMATS, DatasetWriter
from ..errors import UsageError, fail


def _progress(show: bool):
    """A rich progress line on stderr (documents, tokens, MB/s), or None."""
    if not show:
        return None
    from rich.console import Console
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.fields[docs]:,} documents  {task.fields[tokens]:,} tokens  "
                               "{task.fields[mb]:.1f} MB  {task.fields[rate]:.1f} MB/s"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


PROGRESS_EVERY_S = 5.0  # a progress line this often on stderr when it is not a terminal (a log)


class _LogProgress:
    """Off a terminal: one plain line on stderr every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, start: float):
        self.start = self.last = start

    def update(self, docs: int, tokens: int, n_bytes: int) -> None:
        now = time.perf_counter()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last, seconds = now, now - self.start
        print(f"prepare: {docs:,} documents, {tokens:,} tokens, {n_bytes / 1e6:.1f} MB of text in {seconds:.0f} s "
              f"({n_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s)", file=sys.stderr, flush=True)


def _check_like(like: str, vocab: int, eos: int | None) -> None:
    """Refuse a tokenizer whose vocabulary or EOS differ from an existing dataset's (blend sources must match)."""
    other = open_dataset(like)
    if (other.vocab_size is not None and other.vocab_size != vocab) or other.eos != eos:
        raise UsageError(f"--like {like}: that dataset has vocab_size {other.vocab_size}, EOS {other.eos}; this "
                         f"tokenizer gives vocab_size {vocab}, EOS {eos}, so the two cannot be blended")


def prepare(
    inputs: List[Path] = typer.Argument(..., help="Text files or directories: .txt, .jsonl, .jsonl.gz (one JSON "
                                        "object per line), .parquet."),
    out: str = typer.Option(..., "--out", help="Output prefix: writes PREFIX.bin, PREFIX.idx and PREFIX.json."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="A Hugging Face tokenizer.json or a "
                                            "directory saved by save_pretrained (default: bytes)."),
    format: str = typer.Option("par", "--format", help="par (ours) or megatron (Megatron-LM's MMIDIDX .bin/.idx)."),
    text_key: str = typer.Option("text", "--text-key", help="The field (JSONL) or column (Parquet) holding the text."),
    docs: str = typer.Option("file", "--docs", help="Documents of a text file: file, paragraph or line."),
    eos: bool = typer.Option(True, "--eos/--no-eos", help="End every document with the tokenizer's EOS id "
                             "(the byte tokenizer's is 256, so its vocabulary is 257); --no-eos: no separator."),
    eos_token: Optional[str] = typer.Option(None, "--eos-token", help="The EOS token of --tokenizer (default: a "
                                            "directory's eos_token, else the first of <|end_of_text|>, "
                                            "<|endoftext|>, </s>, <eos> it has)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Tokenizing processes, each parsing and "
                                          "tokenizing its own batches (default: the cores; the output is the same "
                                          "for any)."),
    buffer_mb: float = typer.Option(4.0, "--buffer-mb", help="Text per batch handed to a worker; memory is a "
                                    "few batches, not the corpus."),
    like: Optional[str] = typer.Option(None, "--like", help="An existing dataset this one will be blended with: "
                                       "refuse a different vocabulary or EOS."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show documents, tokens and MB/s on "
                                  "stderr: a live line on a terminal, else a line every few seconds."),
) -> None:
    """Tokenize text into a memory-mapped dataset for `[data].path` / `[data].blend` (byte-level unless --tokenizer)."""
    writer = None
    start = time.perf_counter()
    try:
        if docs not in DOC_MODES:
            raise UsageError(f"--docs {docs!r} is not one of {', '.join(DOC_MODES)}")
        if format not in FORMATS:
            raise UsageError(f"--format {format!r} is not one of {', '.join(FORMATS)}")
        if not buffer_mb > 0:
            raise UsageError(f"--buffer-mb {buffer_mb} must be > 0")
        if out.endswith(("/", "\\")) or Path(out).is_dir():
            raise UsageError(f"--out {out!r} is a directory; give a file prefix inside it, e.g. {Path(out) / 'corpus'}")
        files = input_files(inputs)
        tok = get_tokenizer(tokenizer)
        eos_id = None if not eos else tok.eos_id if isinstance(tok, ByteTokenizer) else tok.eos_for(eos_token)
        vocab = 256 if isinstance(tok, ByteTokenizer) and eos_id is None else tok.vocab_size  # bytes only
        if like:
            _check_like(like, vocab, eos_id)
        writer = DatasetWriter(out, vocab, tokenizer=tok.name, eos=eos_id, format=format,
                               tokenizer_sha256=getattr(tok, "sha256", None))
        workers = workers or cores()
        bar = _progress(progress and sys.stderr.isatty())
        task = bar.add_task("prepare", docs=0, tokens=0, mb=0.0, rate=0.0) if bar else None
        log = _LogProgress(start) if progress and not bar else None
        n_docs = n_bytes = 0
        with bar if bar else nullcontext():
            stream = batches(files, docs, text_key, int(buffer_mb * (1 << 20)))
            for ids, lengths, nbytes in encoded_batches(stream, tok, tokenizer, eos_id, workers):
                writer.add(ids, lengths)
                n_docs, n_bytes = n_docs + int((lengths > 0).sum()), n_bytes + nbytes
                if log:
                    log.update(n_docs, writer.num_tokens, n_bytes)
                if bar:
                    mb = n_bytes / 1e6
                    bar.update(task, docs=n_docs, tokens=writer.num_tokens, mb=mb,
                               rate=mb / max(time.perf_counter() - start, 1e-9))
        ds = writer.close()
    except BaseException as e:  # nothing is left half-written: an existing dataset at --out stays as it was
        if writer is not None:
            writer.abort()
        if isinstance(e, UsageError):
            raise fail(str(e))
        if isinstance(e, OSError):
            raise fail(f"cannot write {out}: {e.strerror}")
        raise
    seconds = time.perf_counter() - start
    typer.echo(f"wrote {out}.bin/.idx/.json ({format}): {ds.num_tokens} tokens in {ds.num_docs} documents, "
               f"vocab {ds.vocab_size} ({ds.tokenizer}), EOS {ds.eos}, {n_bytes / 1e6:.1f} MB of text in "
               f"{seconds:.1f} s ({n_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s, {workers} worker(s)); "
               f"unigram entropy {entropy(writer.counts):.3f} nats")
