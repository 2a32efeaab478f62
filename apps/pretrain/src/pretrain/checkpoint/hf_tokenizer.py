"""The tokenizer beside an exported model: what the run's data was prepared with, so that
``AutoTokenizer.from_pretrained(export)`` gives the same ids, EOS and special tokens.

- the byte tokenizer: its ``tokenizer.json`` and ``eos_token``;
- a ``tokenizers`` file or a ``save_pretrained`` directory: the tokenizer.json, and the directory's
  tokenizer config (special tokens, chat template, model max length) as it is; a bare tokenizer.json
  gets a config naming the EOS id the data's header records.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from ..errors import UsageError

# The files of a save_pretrained tokenizer directory that describe it beyond tokenizer.json.
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def _data_header(data: dict) -> dict:
    """The header of the run's (first) dataset: what `prepare` recorded, {} when there is none."""
    prefix = data.get("path") or (data.get("blend") or [[None, ""]])[0][1]
    header = Path(f"{prefix}.json") if prefix else None
    try:
        return json.loads(header.read_text()) if header is not None and header.is_file() else {}
    except (OSError, ValueError):
        return {}


def _source(name: str) -> tuple[Path | None, Path | None]:
    """(tokenizer.json, its save_pretrained directory or None) of a tokenizer name."""
    path = Path(name)
    if path.is_dir():
        return (path / "tokenizer.json" if (path / "tokenizer.json").is_file() else None), path
    if path.is_file():
        return path, (path.parent if (path.parent / "tokenizer_config.json").is_file() else None)
    return None, None


def check_tokenizer(data: dict) -> None:
    """A ``tokenizers`` file is copied only when the dataset header records its sha256 (``prepare``
    does) and the file still has it: a header or config naming any other file (a secret outside the
    run) is refused in one line."""
    header = _data_header(data)
    name = header.get("tokenizer", data.get("tokenizer", "byte"))
    if name in ("", "byte"):
        return
    file, _ = _source(name) if isinstance(name, str) else (None, None)
    if file is None:
        return  # the tokenizer is gone: the weights alone
    recorded = header.get("tokenizer_sha256")
    if recorded is None or hashlib.sha256(file.read_bytes()).hexdigest() != recorded:
        why = "has no recorded sha256" if recorded is None else "does not match the sha256 `prepare` recorded"
        where = f"{data.get('path') or 'the dataset'}.json" if header else "the checkpoint config"
        raise UsageError(f"tokenizer {name!r} named by {where} {why}, so it is not copied into the export; "
                         f"re-run `pretrain prepare` with it, or export the weights alone with --no-tokenizer")


def write_tokenizer(dst: Path, data: dict) -> list[str]:
    """Write the tokenizer of the run's data into ``dst``; the names of the files written."""
    header = _data_header(data)
    name = header.get("tokenizer", data.get("tokenizer", "byte"))
    if name in ("", "byte"):
        from ..data.tokenizer import ByteTokenizer

        tok = ByteTokenizer()
        (dst / "tokenizer.json").write_text(json.dumps(tok.to_json(), ensure_ascii=False))
        return ["tokenizer.json", _write_config(dst, {"eos_token": tok.eos_token})]
    file, directory = _source(name)
    if file is None:
        return []  # the tokenizer is gone: the weights alone
    shutil.copyfile(file, dst / "tokenizer.json")
    if directory is not None and (directory / "tokenizer_config.json").is_file():
        copied = [f for f in CONFIG_FILES if (directory / f).is_file()]
        for f in copied:
            shutil.copyfile(directory / f, dst / f)
        return ["tokenizer.json", *copied]
    return ["tokenizer.json", _write_config(dst, _eos_of(file, header.get("eos")))]


def _eos_of(file: Path, eos_id) -> dict:
    """``{"eos_token": token}`` of the EOS id the data's header records, {} when there is none."""
    if not isinstance(eos_id, int):
        return {}
    from tokenizers import Tokenizer

    token = Tokenizer.from_file(str(file)).id_to_token(eos_id)
    return {"eos_token": token} if token is not None else {}


def _write_config(dst: Path, special: dict) -> str:
    (dst / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}))
    return "tokenizer_config.json"
