"""`pretrain prepare`: byte-level and tokenizer.json tokenization into the dataset format; one-line errors."""

import builtins
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.data import open_dataset

runner = CliRunner()


def test_byte_level_documents_end_with_eos_recorded_in_the_header(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("héllo\n\nworld\n")
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"text": "xy"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    res = runner.invoke(app, ["prepare", str(a), str(j), "--out", str(tmp_path / "out" / "d")])
    assert res.exit_code == 0, res.output
    ds = open_dataset(tmp_path / "out" / "d")
    first = list("héllo\n\nworld\n".encode())
    assert list(ds.tokens) == first + [256] + [ord("x"), ord("y"), 256, ord("z"), 256]
    assert ds.eos == 256 and ds.vocab_size == 257 and ds.tokenizer == "byte"
    assert json.loads((tmp_path / "out" / "d.json").read_text())["eos"] == 256
    assert list(ds.doc_offsets) == [0, len(first) + 1, len(first) + 4, len(first) + 6]
    assert "unigram entropy" in res.stdout
    res = runner.invoke(app, ["prepare", str(a), "--docs", "paragraph", "--out", str(tmp_path / "p")])
    assert res.exit_code == 0 and open_dataset(tmp_path / "p").num_docs == 2


def test_no_eos_writes_the_former_format_which_still_loads(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("ab")
    res = runner.invoke(app, ["prepare", str(a), "--no-eos", "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    header = json.loads((tmp_path / "d.json").read_text())
    assert "eos" not in header and header["vocab_size"] == 256
    ds = open_dataset(tmp_path / "d")
    assert list(ds.tokens) == [97, 98] and ds.eos is None


def _tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3, "</s>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    tok = _tokenizer_json(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("hello world\nworld again\nnope\n")
    res = runner.invoke(app, ["prepare", str(text), "--docs", "line", "--tokenizer", str(tok), "--out", str(tmp_path / "h")])
    assert res.exit_code == 0, res.output
    ds = open_dataset(tmp_path / "h")
    assert list(ds.tokens) == [1, 2, 4, 2, 3, 4, 0, 4] and list(ds.doc_offsets) == [0, 3, 6, 8]
    assert ds.vocab_size == 5 and ds.eos == 4
    res = runner.invoke(app, ["prepare", str(text), "--tokenizer", str(tok), "--eos-token", "again", "--out", str(tmp_path / "a")])
    assert res.exit_code == 0 and open_dataset(tmp_path / "a").eos == 3
    res = runner.invoke(app, ["prepare", str(text), "--tokenizer", str(tok), "--eos-token", "<eot>", "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "has no end-of-document token <eot>" in res.stderr


def test_missing_tokenizers_package_is_a_clear_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    text = tmp_path / "t.txt"
    text.write_text("x")
    res = runner.invoke(app, ["prepare", str(text), "--tokenizer", "tok.json", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "needs the `tokenizers` package" in res.stderr


@pytest.mark.parametrize("setup, args, message", [
    (lambda d: None, ["missing.txt"], "input file(s) not found"),
    (lambda d: (d / "bin.txt").write_bytes(b"\xff\xfe\x00"), ["bin.txt"], "bin.txt is not UTF-8 text"),
    (lambda d: (d / "bad.jsonl").write_text("{\"text\": 1}\n"), ["bad.jsonl"], "bad.jsonl:1 has no string field"),
    (lambda d: (d / "bad2.jsonl").write_text("nope\n"), ["bad2.jsonl"], "bad2.jsonl:1 is not a JSON object"),
    (lambda d: (d / "e.txt").write_text(""), ["e.txt"], "the inputs contain no text"),
    (lambda d: (d / "x.txt").write_text("x"), ["x.txt", "--tokenizer", "no-such.json"], "does not exist"),
    (lambda d: (d / "y.txt").write_text("x"), ["y.txt", "--docs", "words"], "--docs 'words' is not one of"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, monkeypatch, setup, args, message):
    monkeypatch.chdir(tmp_path)
    setup(tmp_path)
    res = runner.invoke(app, ["prepare", *args, "--out", "o"])
    assert res.exit_code == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_jsonl_gz_parquet_and_directories_stream_in_order(tmp_path):
    import gzip

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    with gzip.open(src / "a.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "ab"}) + "\n" + json.dumps({"body": "c"}) + "\n")
    pq.write_table(pa.table({"body": ["de", "f"], "id": [1, 2]}), src / "b.parquet", row_group_size=1)
    (src / "sub" / "c.txt").write_text("g\n\nh\n")
    (src / "notes.md").write_text("not an input")  # unknown suffix inside a directory: skipped
    res = runner.invoke(app, ["prepare", str(src), "--text-key", "body", "--docs", "paragraph", "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    ds = open_dataset(tmp_path / "d")
    assert ds.tokenizer == "byte" and ds.num_docs == 6
    assert bytes(int(t) for t in ds.tokens if t != 256) == b"abcdefg\nh\n" and list(np.diff(ds.doc_offsets)) == [3, 2, 3, 2, 3, 3]


def _saved_tokenizer_directory(tmp_path, eos_token):
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(_tokenizer_json(tmp_path)), eos_token=eos_token)
    tok.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_a_saved_tokenizer_directory_gives_its_eos_and_workers_give_the_same_bytes(tmp_path):
    directory = _saved_tokenizer_directory(tmp_path, eos_token="again")  # not one of the usual EOS names
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": f"hello world {'again ' * (i % 5)}nope"}) + "\n" for i in range(200)))
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        res = runner.invoke(app, ["prepare", str(text), "--tokenizer", str(directory), "--workers", str(workers),
                                  "--buffer-mb", "0.0005", "--format", "megatron", "--out", str(out)])
        assert res.exit_code == 0, res.output
        outs.append([(out.with_suffix(ext)).read_bytes() for ext in (".bin", ".idx")])
    assert outs[0] == outs[1]
    ds = open_dataset(tmp_path / "w2")
    assert ds.eos == 3 and ds.vocab_size == 5 and ds.num_docs == 200
    assert ds.tokens[ds.doc_offsets[3]:ds.doc_offsets[4]].tolist() == [1, 2, 3, 3, 3, 0, 3]


def _reference(files, tok_spec, out, key="text"):
    """The dataset as one process reading each document with sources.texts (the former reader: text
    mode, one line at a time) and encoding them in one batch writes it."""
    from pretrain.data import get_tokenizer
    from pretrain.data.encode import encode
    from pretrain.data.sources import texts
    from pretrain.data.writer import DatasetWriter

    tok = get_tokenizer(tok_spec)
    eos = tok.eos_for(None)
    writer = DatasetWriter(str(out), tok.vocab_size, tokenizer=tok.name, eos=eos, tokenizer_sha256=tok.sha256)
    docs = [t for f in files for t in texts(f, "file", key)]
    writer.add(*encode(tok, docs, eos)[:2])
    writer.close()
    return [out.with_suffix(ext).read_bytes() for ext in (".bin", ".idx", ".json")]


def test_jsonl_parsed_in_workers_is_byte_identical_to_reading_in_one_process(tmp_path, monkeypatch):
    # JSONL is handed to the workers as undecoded blocks of lines (issue 50): blocks smaller than a
    # line, \r\n and bare \r line ends, blank lines, non-ASCII text and gzip give the same bytes as
    # the former one-process reader, for any number of workers; progress lines off a terminal
    import gzip

    from pretrain.commands import prepare as prepare_cmd

    tok = _tokenizer_json(tmp_path)
    words = ["hello", "world", "again", "</s>", "héllo wörld", "nope"]
    lines = [json.dumps({"text": " ".join(words[(i * j) % 6] for j in range(i % 40))}) for i in range(400)]
    ends = ["\n", "\r\n", "\r", "\n\n"]
    raw = ["".join(line + ends[i % 4] for i, line in enumerate(part)) for part in (lines, lines[:200])]
    (tmp_path / "a.jsonl").write_bytes(raw[0].encode())
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(raw[1].encode())
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"]
    want = _reference(files, str(tok), tmp_path / "ref")
    monkeypatch.setattr(prepare_cmd, "PROGRESS_EVERY_S", 0.0)
    for workers, buffer in ((1, "16"), (2, "0.0001"), (3, "0.002")):
        out = tmp_path / f"w{workers}"
        res = runner.invoke(app, ["prepare", *map(str, files), "--tokenizer", str(tok), "--workers", str(workers),
                                  "--buffer-mb", buffer, "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert [out.with_suffix(ext).read_bytes() for ext in (".bin", ".idx")] == want[:2], (workers, buffer)
        assert "prepare: " in res.stderr and " MB/s)" in res.stderr  # CliRunner's stderr is no terminal


def test_a_bad_jsonl_line_is_named_as_before_from_any_worker(tmp_path):
    good = json.dumps({"text": "hello world"})
    (tmp_path / "a.jsonl").write_text("\r\n".join([good] * 300 + ["{not json"] + [good] * 10) + "\n")
    for workers in ("1", "2"):
        res = runner.invoke(app, ["prepare", str(tmp_path / "a.jsonl"), "--workers", workers, "--buffer-mb", "0.0005",
                                  "--out", str(tmp_path / "d")])
        assert res.exit_code == 2 and f"{tmp_path / 'a.jsonl'}:301 is not a JSON object" in res.stderr, res.output


def test_tokenizing_workers_start_clean_not_as_forks_of_the_caller(monkeypatch):
    """A fork of the caller inherits its threads' held locks (a hung worker then ignores the pool's
    SIGTERM and the caller waits forever): the workers come from a clean server instead. Shown by
    state only a fork would carry: the caller's patched ``encode``, which raises."""
    from pretrain.data import encode as encode_module
    from pretrain.data.tokenizer import get_tokenizer

    batches = [["hello world\n", "again\n"], ["more text\n"]]
    want = [encode_module.encode(get_tokenizer(None), texts, None) for texts in batches]

    def forked_state(*args):
        raise RuntimeError("a worker ran the caller's patched encode: it was forked from the caller")

    monkeypatch.setattr(encode_module, "encode", forked_state)
    got = list(encode_module.encoded_batches(batches, None, None, None, workers=2))
    assert all((g[0] == w[0]).all() and (g[1] == w[1]).all() and g[2] == w[2] for g, w in zip(got, want))


def test_the_readme_leaves_workers_at_their_default():
    """More workers than usable cores only compete for them: the README's lines keep the default."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) for line in block.splitlines()]
    assert not [line for line in lines if "pretrain prepare" in line and "--workers" in line], lines
