"""An imported model trains only on data of its tokenizer (issue 50: a 4096-token model imported
without a word trained on the embedded byte corpus, first loss 10.51 against ln 4096 = 8.32).
The import records the source's tokenizer; other data is one `error:` line, exit 2."""

import pytest
import torch
from typer.testing import CliRunner

from pretrain.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TRAIN = ["--nproc", "1", "--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set", "train.eval_every=0",
         "--set", "train.seq_len=16", "--set", "log.progress=false"]


def _hf_model(root, vocab: int):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    return root


def _convert(src, out):
    res = runner.invoke(app, ["convert", "--from-hf", str(src), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return res.output


def _one_error_line(res, *words):
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_a_4096_token_model_on_the_byte_corpus_is_refused(tmp_path):
    out = _convert(_hf_model(tmp_path / "hf", 4096), tmp_path / "ckpt")
    assert "pretrain prepare TEXT --tokenizer" in out  # the import says what data it needs
    res = runner.invoke(app, ["train", str(tmp_path / "ckpt" / "config.toml"), *TRAIN, "--set", f"log.dir={tmp_path / 'r'}"])
    _one_error_line(res, "embedded byte-level corpus", "4096-token vocabulary", "pretrain prepare")


def test_the_recorded_tokenizer_names_the_data_to_prepare_and_trains_on_it(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(299)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    src = _hf_model(tmp_path / "hf", 320)  # the embedding padded past the tokenizer's 300, as Qwen's
    tok.save(str(src / "tokenizer.json"))
    _convert(src, tmp_path / "ckpt")
    config = str(tmp_path / "ckpt" / "config.toml")
    res = runner.invoke(app, ["train", config, *TRAIN, "--set", f"log.dir={tmp_path / 'r1'}"])
    _one_error_line(res, "300-token tokenizer", f"--tokenizer {src.resolve()}")
    (tmp_path / "t.txt").write_text(" ".join(words * 10))
    res = runner.invoke(app, ["prepare", str(tmp_path / "t.txt"), "--tokenizer", str(src), "--eos-token", "w0",
                              "--out", str(tmp_path / "d"), "--no-progress"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["train", config, *TRAIN, "--set", f"log.dir={tmp_path / 'r2'}",
                              "--set", f"data.path={tmp_path / 'd'}"])
    assert res.exit_code == 0, res.output
