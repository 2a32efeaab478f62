"""No file a run creates in ``[log].dir`` or the checkpoint directory is written through a symlink
(issue 49, item 1): a symlink at ``pretrain.pid`` is refused in one line (exit 2); one at any other
name the run writes (``log.jsonl``, ``error.log``, a flight record, ``latest``, the temporary names
they are written under, a ``step_N.tmp`` directory) is replaced, never written through. The user's
files the links point to keep their bytes."""

import hashlib
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()
SMALL = ["train", "--nproc", "1", "--set", "model.layers=1", "--set", "train.steps=1", "--set",
         "train.warmup_steps=1", "--set", "train.eval_every=0", "--set", "log.progress=false"]


def _hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _victims(tmp_path: Path) -> Path:
    mine = tmp_path / "mine"
    (mine / "dir").mkdir(parents=True)
    (mine / "notes.txt").write_text("the user's file\n")
    (mine / "dir" / "keep.txt").write_text("the user's directory\n")
    return mine


def test_a_symlink_at_the_pid_file_is_refused_in_one_line(tmp_path):
    mine, log = _victims(tmp_path), tmp_path / "run"
    log.mkdir()
    (log / "pretrain.pid").symlink_to(mine / "notes.txt")
    before = _hashes(tmp_path)
    res = runner.invoke(app, SMALL + ["--set", f"log.dir={log}"])
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert "pretrain.pid is a symlink" in lines[0] and "Traceback" not in res.output
    assert _hashes(tmp_path) == before


def test_symlinks_at_the_names_a_run_writes_are_replaced_not_written_through(tmp_path):
    mine, log = _victims(tmp_path), tmp_path / "run"
    ck = log / "checkpoints"
    ck.mkdir(parents=True)
    links = {log / "log.jsonl": mine / "notes.txt", log / ".log.jsonl.tmp": mine / "notes.txt",
             ck / ".latest.tmp": mine / "notes.txt", ck / ".manifest.json.tmp": mine / "notes.txt",
             ck / "step_1.tmp": mine / "dir"}
    for link, target in links.items():
        link.symlink_to(target)
    before = _hashes(mine)
    res = runner.invoke(app, SMALL + ["--set", f"log.dir={log}"])
    assert res.exit_code == 0, res.output
    assert _hashes(mine) == before and sorted(p.name for p in (mine / "dir").iterdir()) == ["keep.txt"]
    assert not (log / "log.jsonl").is_symlink() and '"step": 1' in (log / "log.jsonl").read_text()
    assert (ck / "step_1" / "checksums.json").is_file() and not (ck / "step_1").is_symlink()


def test_error_log_and_flight_records_replace_a_symlink(tmp_path):
    from par_groups.watch import CommWatch

    from pretrain.commands.train import _internal_error

    mine, log = _victims(tmp_path), tmp_path / "run"
    (log / "flight").mkdir(parents=True)
    for name in ("error.log", "flight/rank_0.json", "flight/.rank_0.json.tmp"):
        (log / name).symlink_to(mine / "notes.txt")
    before = _hashes(mine)
    with pytest.raises(typer.Exit):
        _internal_error("RuntimeError: boom", "Traceback: the trace\n", str(log))
    CommWatch(4, dump_path=log / "flight" / "rank_0.json").dump("a test")
    assert _hashes(mine) == before
    assert (log / "error.log").read_text() == "Traceback: the trace\n" and not (log / "error.log").is_symlink()
    assert '"reason": "a test"' in (log / "flight" / "rank_0.json").read_text()


@pytest.mark.parametrize("fmt", ["par", "megatron"])
def test_prepare_writes_no_file_through_a_symlink_at_a_temporary_name(tmp_path, fmt):
    from pretrain.data import open_dataset

    mine, out = _victims(tmp_path), tmp_path / "out"
    out.mkdir()
    for ext in ("bin", "idx", "json"):  # the fixed names the writer used to open with open(..., "wb")
        (out / f".c.{ext}.tmp").symlink_to(mine / "notes.txt")
    (tmp_path / "in.txt").write_text("hello world\n")
    before = _hashes(mine)
    res = runner.invoke(app, ["prepare", str(tmp_path / "in.txt"), "--out", str(out / "c"), "--format", fmt,
                              "--no-progress", "--workers", "1"])
    assert res.exit_code == 0, res.output
    assert _hashes(mine) == before
    ds = open_dataset(out / "c")
    assert ds.num_docs == 1 and ds.num_tokens == len("hello world\n") + 1
    assert sorted(p.name for p in out.iterdir() if not p.is_symlink()) == ["c.bin", "c.idx", "c.json"]
