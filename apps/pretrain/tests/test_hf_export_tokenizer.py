"""`convert --to-hf` carries the tokenizer the data was prepared with: a save_pretrained directory's
special tokens, chat template and model max length (issue 50: the export said only
``PreTrainedTokenizerFast``, so its eos_token was None); a bare tokenizer.json gets the data's EOS.
It lists the files it writes, and model.safetensors gets the umask's mode like config.json."""

import os
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pretrain.cli import app

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
runner = CliRunner()
WORDS = ["hello", "world", "again", "nope"]
SPECIAL = {"eos_token": "<|endoftext|>", "bos_token": "<|begin|>", "pad_token": "<pad>"}
FILLER = [f"w{i}" for i in range(300)]  # a vocabulary past the byte tokenizer's (what export checks)
CHAT = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"


def _tokenizer_json(root: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS, *SPECIAL.values(), *FILLER])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    return root / "tokenizer.json"


def _checkpoint_trained_on(tmp_path: Path, tokenizer: str, *extra: str) -> Path:
    """Data prepared with ``tokenizer``, and a model-only checkpoint whose config trains on it."""
    from pretrain.checkpoint.full_model import save_full_model
    from pretrain.checkpoint.store import FORMAT
    from pretrain.config import CheckpointConfig, Config, DataConfig, ModelConfig
    from pretrain.model.shapes import full_shapes

    (tmp_path / "t.txt").write_text(" ".join(WORDS * 50))
    res = runner.invoke(app, ["prepare", str(tmp_path / "t.txt"), "--tokenizer", tokenizer, *extra,
                              "--out", str(tmp_path / "d"), "--no-progress"])
    assert res.exit_code == 0, res.output
    m = ModelConfig(vocab_size=1 + len(WORDS) + len(SPECIAL) + len(FILLER), hidden=16, layers=1, heads=2, kv_heads=2, ffn_hidden=32)
    cfg = Config(model=m, data=DataConfig(path=str(tmp_path / "d")), checkpoint=CheckpointConfig())
    state = {k: torch.randn(s) for k, s in full_shapes(m).items()}
    save_full_model(tmp_path / "ckpt", state, {"format": FORMAT, "step": 0, "config": cfg.to_dict(), "optimizer": False})
    return tmp_path / "ckpt"


def _export(ckpt: Path, dst: Path) -> str:
    res = runner.invoke(app, ["convert", "--to-hf", str(dst), "--checkpoint", str(ckpt)])
    assert res.exit_code == 0, res.output
    return res.output


def test_a_saved_tokenizer_directory_keeps_its_special_tokens_and_chat_template(tmp_path):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(_tokenizer_json(tmp_path / "raw")),
                                                model_max_length=128, **SPECIAL)
    fast.chat_template = CHAT
    fast.save_pretrained(tmp_path / "tok")
    out = _export(_checkpoint_trained_on(tmp_path, str(tmp_path / "tok")), tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    source = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == source.eos_token_id
    assert tok.special_tokens_map == source.special_tokens_map and tok.model_max_length == 128
    assert tok.chat_template == CHAT
    assert tok("hello world", add_special_tokens=False)["input_ids"] == [1, 2]
    listed = re.search(r"\((.*)\)", out).group(1).split(", ")
    assert sorted(listed) == sorted(p.name for p in (tmp_path / "hf").iterdir())  # what it wrote, all of it


def test_a_bare_tokenizer_json_gets_the_datas_eos(tmp_path):
    file = _tokenizer_json(tmp_path / "raw")
    _export(_checkpoint_trained_on(tmp_path, str(file), "--eos-token", "<|endoftext|>"), tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == len(WORDS) + 1


def test_the_weights_get_the_umasks_mode(tmp_path):
    old = os.umask(0o022)
    try:
        _export(_checkpoint_trained_on(tmp_path, str(_tokenizer_json(tmp_path / "raw"))), tmp_path / "hf")
    finally:
        os.umask(old)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o644
