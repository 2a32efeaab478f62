"""Bad pretraining data, through `pretrain train` and `pretrain prepare`: each is one `error:` line
naming the file, exit 2, and no file in the directory changed (an existing dataset at --out included)."""

import hashlib
import json
import struct

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.data import write_dataset

runner = CliRunner()
TRAIN = ["train", "--nproc", "1", "--set", "model.layers=1", "--set", "train.steps=2", "--set", "train.warmup_steps=1",
         "--set", "train.eval_every=0", "--set", "log.progress=false", "--set", "log.dir=run", "--set", "train.seq_len=16"]


def _megatron(path, mutate=None):
    write_dataset(path, [list(range(1, 200))] * 10, 256, format="megatron")
    if mutate:
        mutate(path)


def _set_idx(path, offset, data):
    idx = bytearray(open(f"{path}.idx", "rb").read())
    idx[offset:offset + len(data)] = data
    open(f"{path}.idx", "wb").write(bytes(idx))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    w = tmp_path_factory.mktemp("data_bad")
    write_dataset(w / "good", [list(range(1, 200))] * 10, 256)
    _megatron(w / "mgood")
    _megatron(w / "truncated", lambda p: open(f"{p}.bin", "r+b").truncate(1000))
    _megatron(w / "pointers", lambda p: _set_idx(p, 34 + 4 * 10 + 8 * 9, struct.pack("<q", 10 ** 6)))
    _megatron(w / "magic", lambda p: _set_idx(p, 0, b"NOTMEGA!!"))
    _megatron(w / "dtype", lambda p: _set_idx(p, 17, struct.pack("<B", 7)))  # float32: no token ids
    (w / "nokey.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    (w / "corrupt.parquet").write_bytes(b"PAR1" + bytes(100) + b"PAR1")
    (w / "corrupt.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(20))
    (w / "good.txt").write_text("some text\n")
    (w / "emptydir").mkdir()
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"body": ["x", "y"]}), w / "body.parquet")
    return w


def _snapshot(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


CASES = {
    "truncated .bin": (TRAIN + ["--set", "data.path=truncated"], "truncated.idx: sequence 2 (pointer 796"),
    ".idx pointers past the .bin": (TRAIN + ["--set", "data.path=pointers"], "runs past pointers.bin"),
    "wrong magic": (TRAIN + ["--set", "data.path=magic"], "magic.idx starts with b'NOTMEGA!!'"),
    "unknown dtype code": (TRAIN + ["--set", "data.path=dtype"], "dtype.idx has dtype code 7"),
    "blend weight 0": (TRAIN + ["--set", 'data.blend=[[0.0, "good"], [1, "mgood"]]'], "weight 0.0 of 'good' must be"),
    "blend weight < 0": (TRAIN + ["--set", 'data.blend=[[-1, "good"], [1, "mgood"]]'], "weight -1 of 'good' must be"),
    "missing blend source": (TRAIN + ["--set", 'data.blend=[[1, "good"], [1, "nosuch"]]'], "dataset 'nosuch' is missing"),
    "missing eval set": (TRAIN + ["--set", "data.path=good", "--set", "data.eval_path=nosuch"], "'nosuch' is missing"),
    "jsonl without the key": (["prepare", "nokey.jsonl", "--out", "good"], "nokey.jsonl:2 has no string field \"text\""),
    "corrupt parquet": (["prepare", "good.txt", "corrupt.parquet", "--out", "good"], "corrupt.parquet is not a readable"),
    "corrupt gzip": (["prepare", "corrupt.jsonl.gz", "--out", "good"], "corrupt.jsonl.gz is not a readable gzip"),
    "parquet without the column": (["prepare", "body.parquet", "--out", "good"], "body.parquet has no column \"text\""),
    "unknown --format": (["prepare", "good.txt", "--out", "good", "--format", "tar"], "--format 'tar' is not one of"),
    "empty directory": (["prepare", "emptydir", "--out", "good"], "directory emptydir holds no"),
    "--like another vocabulary": (["prepare", "good.txt", "--like", "mgood", "--out", "x"],
                                  "--like mgood: that dataset has vocab_size 256, EOS None; this tokenizer gives "
                                  "vocab_size 257, EOS 256"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_data_is_one_line_naming_the_file(workspace, monkeypatch, name):
    monkeypatch.chdir(workspace)
    before = _snapshot(workspace)
    args, message = CASES[name]
    res = runner.invoke(app, args)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, (name, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (name, res.stderr)
    assert _snapshot(workspace) == before, name


def test_a_mismatched_blend_is_refused_in_one_line(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    write_dataset(workspace / "eos", [list(range(1, 200))] * 10, 257, eos=256)
    res = runner.invoke(app, TRAIN + ["--set", "model.vocab_size=257", "--set", 'data.blend=[[1, "good"], [1, "eos"]]'])
    assert res.exit_code == 2 and "dataset eos has vocab_size 257, EOS 256 but good has vocab_size 256, EOS None" \
        in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output
