"""A blend of three sources (both formats) through `pretrain train`: stopped mid-way and resumed, the
losses are bitwise the uninterrupted run's, and log.jsonl's per-source shares stay within one
sample of the weights at every step."""

import json

from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.data import embedded_dataset, write_dataset

runner = CliRunner()
WEIGHTS = (0.5, 0.3, 0.2)


def _records(log_dir):
    return [r for r in map(json.loads, (log_dir / "log.jsonl").read_text().splitlines()) if "loss" in r]


def test_three_source_blend_resumes_bitwise_with_shares_within_one_sample(tmp_path):
    sources = []
    for k, fmt in enumerate(("par", "megatron", "par")):
        ds = embedded_dataset(seed=k, num_tokens=40_000, eos=True)
        docs = [ds.tokens[a:b - 1] for a, b in zip(ds.doc_offsets[:-1], ds.doc_offsets[1:])]
        write_dataset(tmp_path / f"src{k}", docs, 257, eos=256, format=fmt)
        sources.append(str(tmp_path / f"src{k}"))
    blend = "[" + ", ".join(f'[{w}, "{p}"]' for w, p in zip(WEIGHTS, sources)) + "]"
    base = ["train", "--nproc", "2", "--set", "train.steps=6", "--set", "train.warmup_steps=2", "--set",
            "train.eval_every=3", "--set", "train.eval_batches=1", "--set", "model.layers=2", "--set", "log.progress=false",
            "--set", "model.vocab_size=257", "--set", "train.global_batch=10", "--set", "train.micro_batch=5",
            "--set", f"data.blend={blend}", "--set", "data.document_mask=true"]
    ck = tmp_path / "ck"
    runs = [("full", []), ("a", ["--set", "train.stop_at=3", "--set", f"checkpoint.dir={ck}"]),
            ("b", ["--set", "checkpoint.resume=true", "--set", f"checkpoint.dir={ck}"])]
    for name, extra in runs:
        res = runner.invoke(app, base + ["--set", f"log.dir={tmp_path / name}"] + extra)
        assert res.exit_code == 0, res.output
    full, a, b = (_records(tmp_path / n) for n, _ in runs)
    assert [r["step"] for r in a] == [1, 2, 3] and [r["step"] for r in b] == [4, 5, 6]
    assert [r["loss"] for r in a + b] == [r["loss"] for r in full]  # bitwise equal floats
    assert [r["data_samples"] for r in a + b] == [r["data_samples"] for r in full]
    for r in full:
        counts = [r["data_samples"][p] for p in sources]
        assert sum(counts) == 10 * r["step"]
        assert all(abs(c - w * 10 * r["step"]) < 1 for c, w in zip(counts, WEIGHTS)), r
        assert abs(sum(r["data_share"].values()) - 1) < 1e-12
