"""Tokenizers for `pretrain prepare`: bytes by default (no files, no downloads), or a Hugging Face
tokenizer: a tokenizer.json, or a directory saved by ``save_pretrained`` (its tokenizer.json, and
the EOS its tokenizer_config.json names)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import UsageError


# End-of-document tokens of common tokenizer.json files (Llama 3, GPT-2/NeoX, Llama 2/Mistral, Gemma).
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, lossless for any text, and one reserved id: 256 = EOS."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[bytes]:
        return [t.encode("utf-8") for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    eos_token = "<|endoftext|>"

    def to_json(self) -> dict:
        """This tokenizer as a Hugging Face ``tokenizer.json``: byte-level BPE without merges, so
        every byte is its own id (GPT-2's byte-to-character map), and EOS = 256 as a special token."""
        chars = _gpt2_byte_chars()
        level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        return {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
                "added_tokens": [{"id": self.eos_id, "content": self.eos_token, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True}],
                "pre_tokenizer": level, "decoder": level,
                "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                          "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                          "vocab": {chars[b]: b for b in range(256)}, "merges": []}}


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable character for each byte (what a ByteLevel pre-tokenizer maps bytes to)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _configured_eos(directory: Path) -> str | None:
    """The ``eos_token`` of a saved tokenizer's tokenizer_config.json (or special_tokens_map.json)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            token = json.loads((directory / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token:
            return token
    return None


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer.json or a ``save_pretrained`` directory holding one
    (optional dependency: ``pip install tokenizers``)."""

    def __init__(self, path: str):
        self.configured_eos = None
        if Path(path).is_dir():
            self.configured_eos = _configured_eos(Path(path))
            if not (Path(path) / "tokenizer.json").is_file():
                raise UsageError(f"tokenizer directory {path!r} has no tokenizer.json (save a fast tokenizer with "
                                 f"save_pretrained, or give a tokenizer.json file)")
            path = str(Path(path) / "tokenizer.json")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError(f"--tokenizer {path} needs the `tokenizers` package; install it with "
                             "`uv pip install tokenizers` (or use the default byte tokenizer)") from None
        if not Path(path).is_file():
            raise UsageError(f"tokenizer file {path!r} does not exist (give a tokenizer.json or a directory saved "
                             f"by save_pretrained)")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception type for malformed files
            raise UsageError(f"tokenizer file {path!r} could not be read: {e}") from None
        self.name = str(path)
        self.sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest()  # recorded: export copies only this file
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def eos_for(self, token: str | None) -> int:
        """The id of ``token``, else of the tokenizer directory's configured EOS, else of the first of
        :data:`EOS_CANDIDATES` the vocabulary has."""
        names = (token,) if token else (self.configured_eos,) if self.configured_eos else EOS_CANDIDATES
        for name in names:
            found = self._tok.token_to_id(name)
            if found is not None:
                return int(found)
        raise UsageError(f"tokenizer {self.name!r} has no end-of-document token {' or '.join(names)}; "
                         f"name one with --eos-token TOKEN, or pass --no-eos")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def get_tokenizer(spec: str | None):
    """'byte' (or None) -> :class:`ByteTokenizer`; a tokenizer.json or a directory -> :class:`HFTokenizer`."""
    if spec in (None, "", "byte"):
        return ByteTokenizer()
    return HFTokenizer(spec)
