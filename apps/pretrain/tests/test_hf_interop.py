"""Hugging Face interop: a tiny random LlamaForCausalLM (built offline, the byte tokenizer's vocabulary
257: padded to 384 rows on 1 rank, 512 under tp = 2) imported with `pretrain convert` gives
transformers' logits (fp32, <= 1e-5) on 1 rank, tp = 2 and pp = 2; export strips the pad and
reproduces its tensors exactly, with a tokenizer.json AutoTokenizer reads; `pretrain train` starts
from the imported checkpoint."""

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from pretrain.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()
SEQ, BATCH = 16, 2


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      rope_theta=5000.0, tie_word_embeddings=False, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all ones, so a wrong norm mapping shows
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(root / "hf", safe_serialization=True)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    res = runner.invoke(app, ["convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt")])
    assert res.exit_code == 0, res.output
    return root, tokens, logits


def logits_job(ckpt, overrides, tokens):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config(f"{ckpt}/config.toml", [f"train.seq_len={SEQ}", "train.eval_every=0"] + overrides)
    trainer = Trainer(cfg)
    trainer.load_checkpoint(ckpt, model_only=True)
    return trainer.logits(tokens)


@pytest.mark.parametrize("overrides,world", [([], 1), (["parallel.tp=2"], 2), (["parallel.pp=2"], 2)])
def test_imported_model_gives_transformers_logits(dist_run, hf_model, overrides, world):
    root, tokens, want = hf_model
    for got in dist_run(world, logits_job, str(root / "ckpt"), overrides, tokens):
        got = got.permute(1, 0, 2)
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), overrides


def test_export_round_trip_reproduces_the_tensors_exactly(hf_model):
    from safetensors.torch import load_file

    root, _, _ = hf_model
    res = runner.invoke(app, ["convert", "--to-hf", str(root / "back"), "--checkpoint", str(root / "ckpt")])
    assert res.exit_code == 0, res.output
    a, b = load_file(str(root / "hf" / "model.safetensors")), load_file(str(root / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)
    from pretrain.checkpoint.hf import model_config_from_hf

    original = json.loads((root / "hf" / "config.json").read_text())
    back = json.loads((root / "back" / "config.json").read_text())
    assert model_config_from_hf(back) == model_config_from_hf(original)
    assert transformers.LlamaForCausalLM.from_pretrained(root / "back") is not None
    tok = transformers.AutoTokenizer.from_pretrained(root / "back")  # the byte tokenizer the data would use
    text = "héllo\n wörld"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode()) and tok.eos_token_id == 256
    assert tok.decode(list(text.encode())) == text


def test_training_starts_from_the_imported_checkpoint(hf_model, tmp_path):
    root, _, _ = hf_model
    res = runner.invoke(app, ["train", str(root / "ckpt" / "config.toml"), "--nproc", "1", "--set", "train.steps=2",
                              "--set", "train.warmup_steps=1", "--set", "train.eval_every=0",
                              "--set", "log.progress=false", "--set", f"log.dir={tmp_path}"])
    assert res.exit_code == 0, res.output
    assert "weights from" in res.output
    assert 'dir = "runs/ckpt"' in (root / "ckpt" / "config.toml").read_text()  # the log.dir, named after --out


def test_convert_bad_input_is_one_clear_line(tmp_path):
    res = runner.invoke(app, ["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "no config.json" in res.stderr
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    res = runner.invoke(app, ["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "gpt2" in res.stderr
    res = runner.invoke(app, ["convert"])
    assert res.exit_code == 2 and res.stderr.startswith("error: ")


def test_every_hf_field_is_read_with_its_type():  # issue 40: "false" imported as true, a list's .get raised
    from pretrain.checkpoint.hf_fields import hf_value
    from pretrain.errors import UsageError

    hf = {"tie": "false", "flag": True, "size": 64, "eps": 1, "scaling": None, "big": float("inf"), "zero": 0}
    assert hf_value(hf, "flag", "bool", "c.json") is True and hf_value(hf, "eps", "number", "c.json") == 1.0
    assert hf_value(hf, "scaling", "size", "c.json", 3) == 3 and hf_value(hf, "absent", "size", "c.json", 7) == 7
    assert hf_value(hf, "zero", "count", "c.json") == 0
    for key, kind, message in (("tie", "bool", "tie='false' must be true or false"),
                               ("flag", "size", "must be a positive integer"), ("zero", "size", "positive integer"),
                               ("big", "number", "must be a finite positive number"), ("absent", "size", "missing absent")):
        with pytest.raises(UsageError, match=re.escape(message)):
            hf_value(hf, key, kind, "c.json")
