"""Tokenizers for `pretrain prepare`: bytes by default (no files, no downloads), or a HF tokenizer.json."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError


class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary 256, lossless for any text."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer.json (optional dependency: ``pip install tokenizers``)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError(f"--tokenizer {path} needs the `tokenizers` package; install it with "
                             "`uv pip install tokenizers` (or use the default byte tokenizer)") from None
        if not Path(path).is_file():
            raise UsageError(f"tokenizer file {path!r} does not exist")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception type for malformed files
            raise UsageError(f"tokenizer file {path!r} could not be read: {e}") from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def get_tokenizer(spec: str | None):
    """'byte' (or None) -> :class:`ByteTokenizer`; a path -> :class:`HFTokenizer`."""
    if spec in (None, "", "byte"):
        return ByteTokenizer()
    return HFTokenizer(spec)
