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
