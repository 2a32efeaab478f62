"""`pretrain train`: bad input is one line and exit code 2; a short run on 2 ranks trains and logs."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--set", "parallel.tpp=2"], "unknown key [parallel].tpp"),
        (["--nproc", "3", "--set", "parallel.tp=2"], "world"),
        (["--nproc", "2", "--set", "model.heads=6", "--set", "model.kv_heads=6", "--set", "model.hidden=48", "--set", "parallel.tp=4", "--nproc", "4"], "heads"),
        (["--nproc", "2", "--set", "parallel.pp=2", "--set", "model.layers=3"], "layers"),
        (["--set", "data.path=/nonexistent/corpus"], "/nonexistent/corpus"),
        (["--nproc", "100000"], "--nproc 100000"),
        (["--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.zero=torch_fsdp2"], "torch_fsdp2"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(args, needle):
    res = runner.invoke(app, ["train", *args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr
    assert "Traceback" not in res.output


def test_malformed_data_file_is_a_clear_error(tmp_path):
    (tmp_path / "bad.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "bad.json").write_text("{not json")
    res = runner.invoke(app, ["train", "--set", f"data.path={tmp_path / 'bad'}"])
    assert res.exit_code == 2 and res.stderr.startswith("error: ") and "Traceback" not in res.output


@pytest.mark.timeout(300)  # a whole run on two ranks
def test_short_run_on_two_ranks_learns_and_writes_log_jsonl(tmp_path):
    """With Megatron's train/valid/test split: the test part's loss once, at the end."""
    res = runner.invoke(app, ["train", "--nproc", "2", "--set", "train.steps=12", "--set", "train.warmup_steps=2",
                              "--set", "train.eval_every=6", "--set", f"log.dir={tmp_path}",
                              "--set", "data.split=[90, 5, 5]"])
    assert res.exit_code == 0, res.output
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert [r["step"] for r in records if "eval_loss" in r] == [6, 12]
    assert [r["step"] for r in records if "test_loss" in r] == [12]
