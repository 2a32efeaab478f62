"""Keys a user coming from Megatron-LM or torchtitan looks for: a shortened run's warm-up, the new
[train] schedule keys' bad input, model flavours, torchtitan's per-rank batch."""

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.config import load_config
from pretrain.errors import UsageError

from one_error_line import assert_one_error_line

CLAMPED = ("note: [train].warmup_steps=20 is more than the run's steps=2: warm-up clamped to 2 steps "
           "(set [train].warmup_steps to choose)\n")


def test_shortening_a_run_clamps_the_configs_warmup_with_one_note(capsys, monkeypatch):
    assert load_config(None, ["train.steps=2"]).train.warmup_steps == 2  # tiny.toml's 20, shortened by --set
    assert capsys.readouterr().err == CLAMPED
    monkeypatch.setenv("PRETRAIN_SET", "train.steps=2")  # the README's CI line
    assert load_config("llama3-8b").train.warmup_steps == 2
    assert "warmup_steps=2000 is more than the run's steps=2" in capsys.readouterr().err
    monkeypatch.delenv("PRETRAIN_SET")
    assert load_config(None, ["train.steps=30"]).train.warmup_steps == 20  # long enough: untouched, quiet
    assert capsys.readouterr().err == ""


def test_a_file_without_warmup_takes_the_default_clamped(tmp_path, capsys):
    toml = tmp_path / "short.toml"
    toml.write_text("[train]\nsteps = 5\n")
    assert load_config(str(toml)).train.warmup_steps == 5
    assert "warmup_steps=20 is more than the run's steps=5" in capsys.readouterr().err


@pytest.mark.parametrize("sets", [["train.steps=2", "train.warmup_steps=5"], ["train.warmup_steps=400"]])
def test_warmup_and_steps_both_chosen_inconsistently_is_one_line_naming_the_key(sets, tmp_path):
    args = ["plan", "--world", "1"] + [a for s in sets for a in ("--set", s)]
    assert_one_error_line(CliRunner().invoke(app, args), str(sets), "set [train].warmup_steps to at most")
    toml = tmp_path / "both.toml"  # both in one file: the file's author chose them, an error too
    toml.write_text("[train]\nsteps = 5\nwarmup_steps = 9\n")
    with pytest.raises(UsageError, match=r"warmup_steps=9 exceeds steps=5; set \[train\].warmup_steps to at most 5"):
        load_config(str(toml))


def test_a_flavor_is_a_shipped_configs_model_section_under_its_own_or_torchtitans_name():
    eight = load_config("llama3-8b").model
    for name in ("llama3-8b", "8B"):
        m = load_config(None, [f"model.flavor={name}"]).model  # replaces tiny.toml's [model]
        assert (m.hidden, m.layers, m.ffn_hidden, m.vocab_size, m.rope_theta, m.rope_scaling) == \
            (eight.hidden, eight.layers, eight.ffn_hidden, eight.vocab_size, eight.rope_theta, eight.rope_scaling)
    # later --set model.* apply on top; a flavor in a file is the base of that file's [model] keys
    assert load_config(None, ["model.flavor=debugmodel", "model.layers=2"]).model.layers == 2
    assert load_config(None, ["model.layers=2", "model.flavor=debugmodel"]).model.layers == 2
    cfg = load_config(None, ["model.flavor=debugmodel"])
    assert cfg.model.hidden == load_config("tiny").model.hidden
    with pytest.raises(UsageError, match=r"\[model\].flavor='9B' is not one of deepseek-v3, .*8B"):
        load_config(None, ["model.flavor=9B"])


def test_round_trip_keeps_a_flavored_config(tmp_path):
    cfg = load_config(None, ["model.flavor=tiny-moe", "train.lr_decay_style=wsd", "train.lr_wsd_decay_ratio=0.2"])
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    assert load_config(str(tmp_path / "c.toml")) == cfg


def test_local_batch_is_per_data_parallel_rank(capsys):
    cfg = load_config(None, ["train.local_batch=4", "parallel.tp=2"])
    layout = cfg.validate_world(8)  # dp = 4
    assert cfg.train.global_batch == 16 and layout.micro_batch * layout.microbatches == 4
    cfg = load_config(None, ["train.local_batch_size=2"])  # torchtitan's name: the same key, and a note
    assert cfg.train.local_batch == 2 and "[train].local_batch_size is [train].local_batch here" in capsys.readouterr().err
    cfg.validate_world(2)
    assert cfg.train.global_batch == 4


@pytest.mark.parametrize("sets, message", [
    (["train.lr_decay_style=step"], "[train].lr_decay_style='step' is not one of cosine, linear, wsd, inverse-square-root"),
    (["train.lr_decay_style=wsd"], "[train].lr_decay_style='wsd' needs a decay phase in 1..280"),
    (["train.lr_decay_style=wsd", "train.lr_wsd_decay_steps=281"], "needs a decay phase in 1..280"),
    (["train.lr_wsd_decay_style=exp"], "[train].lr_wsd_decay_style='exp' is not one of linear, cosine, exponential"),
    (["train.lr_wsd_decay_ratio=1.5"], "[train].lr_wsd_decay_ratio=1.5 must be in [0, 1]"),
    (["train.lr_decay_steps=-1"], "[train].lr_decay_steps=-1 must be >= 0"),
    (["train.lr_decay_steps=10"], "[train].warmup_steps=20 exceeds lr_decay_steps=10"),
    (["train.train_samples=7"], "[train].train_samples=7 is less than one step of global_batch=8"),
    (["train.lr_warmup_samples=-8"], "[train].lr_warmup_samples=-8 must be >= 0"),
    (["train.adam_eps=0"], "[train].adam_eps=0.0 must be > 0"),
    (["train.local_batch=-1"], "[train].local_batch=-1 must be >= 0"),
])
def test_new_keys_bad_input_is_one_line_naming_the_key(sets, message):
    args = ["plan", "--world", "1"] + [a for s in sets for a in ("--set", s)]
    assert_one_error_line(CliRunner().invoke(app, args), str(sets), message)
