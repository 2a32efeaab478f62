"""An imported model trains on data tokenized with its own tokenizer (otherwise a 4096-token model
would train on the embedded byte corpus without a word).

The import records the source directory's tokenizer (when it has a tokenizer.json) and its
vocabulary; training from the import refuses data whose tokenizer's vocabulary is another one.
Without a recorded tokenizer only byte-level data can be told apart: it fits a model of 256 or 257
tokens (the bytes, and EOS)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError

BYTE_VOCABS = (256, 257)


def source_tokenizer(src: Path) -> dict:
    """``{"tokenizer": dir, "tokenizer_vocab": n}`` of a save_pretrained directory holding a
    tokenizer.json, {} when it has none (or it cannot be read)."""
    if not (src / "tokenizer.json").is_file():
        return {}
    try:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    except Exception:  # no `tokenizers`, or a file it cannot read: the import still works, unchecked
        return {"tokenizer": str(src.resolve())}
    return {"tokenizer": str(src.resolve()), "tokenizer_vocab": vocab}


def check_data_matches_import(saved: dict, datasets: list, model_vocab: int) -> None:
    """Refuse data of another tokenizer than the imported model's (``saved``: its trainer state)."""
    source = str(saved.get("source", ""))
    if not source.startswith("huggingface:"):
        return
    want, tokenizer = saved.get("tokenizer_vocab"), saved.get("tokenizer")
    for ds in datasets:
        byte = ds.tokenizer == "byte"
        if (byte and (want or model_vocab) not in BYTE_VOCABS) or (not byte and want and ds.vocab_size not in (None, want)):
            what = "the embedded byte-level corpus ([data].path = \"\")" if str(ds.source).startswith("<embedded") \
                else f"dataset {ds.source}"
            has = "byte-level (vocabulary 257)" if byte else f"tokenized by {ds.tokenizer} (vocabulary {ds.vocab_size})"
            model = f"{want}-token tokenizer" if want else f"{model_vocab}-token vocabulary"
            prepare = f"pretrain prepare TEXT --tokenizer {tokenizer or 'ITS_TOKENIZER'} --out data/NAME"
            raise UsageError(f"{what} is {has}, but the model imported from {source[len('huggingface:'):]} has a "
                             f"{model}: prepare data with its tokenizer ({prepare}) and train with "
                             f"--set data.path=data/NAME")
