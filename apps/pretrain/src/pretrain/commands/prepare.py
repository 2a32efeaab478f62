"""`pretrain prepare`: tokenize text files into the memory-mapped token dataset (see pretrain.data.format)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, List, Optional

import typer

from ..data import ByteTokenizer, get_tokenizer, write_dataset
from ..errors import UsageError, fail

DOC_MODES = ("file", "paragraph", "line")


def _texts(path: Path, docs: str) -> Iterator[str]:
    """The documents of one input: a .jsonl gives one per line (its "text"); text files by ``docs``."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    if path.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise UsageError(f"{path}:{number} is not a JSON object") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UsageError(f"{path}:{number} has no string field \"text\"")
            yield record["text"]
    elif docs == "file":
        yield text
    elif docs == "line":
        yield from (line + "\n" for line in text.splitlines() if line.strip())
    else:
        yield from (p.strip() + "\n" for p in text.split("\n\n") if p.strip())


def prepare(
    inputs: List[Path] = typer.Argument(..., help="Text files (.jsonl: one JSON object with \"text\" per line)."),
    out: str = typer.Option(..., "--out", help="Output prefix: writes PREFIX.bin, PREFIX.idx and PREFIX.json."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="A Hugging Face tokenizer.json (default: bytes)."),
    docs: str = typer.Option("file", "--docs", help="Documents of a text file: file, paragraph or line."),
    eos: bool = typer.Option(True, "--eos/--no-eos", help="End every document with the tokenizer's EOS id "
                             "(the byte tokenizer's is 256, so its vocabulary is 257); --no-eos: no separator."),
    eos_token: Optional[str] = typer.Option(None, "--eos-token", help="The EOS token of --tokenizer (default: "
                                            "the first of <|end_of_text|>, <|endoftext|>, </s>, <eos> it has)."),
) -> None:
    """Tokenize text into a memory-mapped dataset for `[data].path` (byte-level unless --tokenizer)."""
    try:
        if docs not in DOC_MODES:
            raise UsageError(f"--docs {docs!r} is not one of {', '.join(DOC_MODES)}")
        if out.endswith(("/", "\\")) or Path(out).is_dir():
            raise UsageError(f"--out {out!r} is a directory; give a file prefix inside it, e.g. {Path(out) / 'corpus'}")
        missing = [str(p) for p in inputs if not p.is_file()]
        if missing:
            raise UsageError(f"input file(s) not found: {', '.join(missing)}")
        tok = get_tokenizer(tokenizer)
        eos_id = None if not eos else tok.eos_id if isinstance(tok, ByteTokenizer) else tok.eos_for(eos_token)
        encoded = (tok.encode(text) for path in inputs for text in _texts(path, docs))
        vocab = 256 if isinstance(tok, ByteTokenizer) and eos_id is None else tok.vocab_size  # bytes only
        ds = write_dataset(out, encoded, vocab, tokenizer=tok.name, eos=eos_id)
    except UsageError as e:
        raise fail(str(e))
    except OSError as e:
        raise fail(f"cannot write {out}: {e.strerror}")
    typer.echo(f"wrote {out}.bin/.idx/.json: {ds.num_tokens} tokens in {ds.num_docs} documents, "
               f"vocab {ds.vocab_size} ({ds.tokenizer}), EOS {ds.eos}, unigram entropy {ds.unigram_entropy():.3f} nats")
