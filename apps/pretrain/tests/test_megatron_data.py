"""Megatron-LM's indexed dataset and blends, against megatron-core itself (a test-only dependency):
its IndexedDatasetBuilder's files read by par token for token, `prepare --format megatron` read by
its IndexedDataset, par's blend choosing its build_blending_indices' source for every sample."""

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.config import load_config
from pretrain.data import TokenSampler, build_sampler, load_dataset, open_dataset, write_dataset
from pretrain.data.blend import BlendSchedule, anchor_counts, normalised
from pretrain.errors import UsageError

indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
helpers_cpp = pytest.importorskip("megatron.core.datasets.helpers_cpp")
runner = CliRunner()


def _megatron_documents(rng, n_docs, vocab):
    """Documents of one to three sequences (Megatron's sentence-split layout), as lists of arrays."""
    return [[rng.integers(0, vocab, size=int(rng.integers(1, 9))) for _ in range(int(rng.integers(1, 4)))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("dtype, vocab", [(np.uint16, 60000), (np.int32, 70000)])
def test_a_dataset_megatron_core_wrote_is_read_token_for_token(tmp_path, dtype, vocab):
    docs = _megatron_documents(np.random.default_rng(0), 40, vocab)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for doc in docs:
        for sequence in doc:
            builder.add_item(torch.from_numpy(sequence.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ds = open_dataset(tmp_path / "m")
    assert ds.format == "megatron" and ds.tokens.dtype == dtype and ds.vocab_size is None and ds.eos is None
    assert np.array_equal(ds.tokens, np.concatenate([np.concatenate(d) for d in docs]))
    assert np.array_equal(np.diff(ds.doc_offsets), [sum(map(len, d)) for d in docs])  # document, not sequence, bounds
    theirs = indexed.IndexedDataset(str(tmp_path / "m"))
    for d in range(0, 40, 7):
        lo, hi = theirs.document_indices[d], theirs.document_indices[d + 1]
        want = np.concatenate([theirs[s] for s in range(lo, hi)])
        assert np.array_equal(ds.tokens[ds.doc_offsets[d]:ds.doc_offsets[d + 1]], want)


def test_prepare_format_megatron_is_read_by_megatron_core_identically(tmp_path):
    text = tmp_path / "t.jsonl"
    text.write_text("".join(f'{{"text": "doc {i} ' + "x" * i + '"}\n' for i in range(30)))
    res = runner.invoke(app, ["prepare", str(text), "--format", "megatron", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    theirs = indexed.IndexedDataset(str(tmp_path / "o"))
    ours = open_dataset(tmp_path / "o")
    assert len(theirs) == 30 and list(theirs.document_indices) == list(range(31))
    for i in range(30):
        want = list(f"doc {i} {'x' * i}".encode()) + [256]
        assert theirs[i].tolist() == want
        assert ours.tokens[ours.doc_offsets[i]:ours.doc_offsets[i + 1]].tolist() == want
    assert ours.eos == 256 and ours.vocab_size == 257 and theirs.index.dtype == np.uint16


def test_megatron_datasets_train_with_document_keys_given_their_eos(tmp_path):
    write_dataset(tmp_path / "m", [[5, 6, 7]] * 2000, vocab_size=300, eos=299, format="megatron")
    (tmp_path / "m.json").unlink()  # as Megatron's own tool writes it: no vocabulary, no EOS
    cfg = load_config(None, [f"data.path={tmp_path / 'm'}", "data.eod_mask_loss=true"])
    with pytest.raises(UsageError, match="set \\[data\\].eos for a Megatron dataset"):
        load_dataset(cfg.data, 300)
    cfg = load_config(None, [f"data.path={tmp_path / 'm'}", "data.eod_mask_loss=true", "data.eos=299",
                             "model.vocab_size=300"])
    assert load_dataset(cfg.data, 300).eos == 299
    b = build_sampler(cfg, cfg.validate_world(1), 0).global_train_batch(0)
    assert torch.equal(b.segments[0, :9], torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2], dtype=torch.int32))


@pytest.mark.parametrize("weights", [[0.3, 0.5, 0.2], [1, 1, 1], [0.7, 0.2, 0.05, 0.05], [3, 1]])
def test_blend_chooses_megatron_cores_source_for_every_sample(weights):
    n = 5000
    source, index = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    helpers_cpp.build_blending_indices(source, index, w / w.sum(), len(w), n, False)
    ours = BlendSchedule(weights)
    got_source, got_index = ours.take(0, n)
    assert np.array_equal(got_source, source) and np.array_equal(got_index, index)
    later = BlendSchedule(weights).take(3001, 3517)  # from any sample on, no history needed
    assert np.array_equal(later[0], source[3001:3517]) and np.array_equal(later[1], index[3001:3517])
    assert np.array_equal(ours.take(10, 20)[0], source[10:20])  # going back restarts the walk


def _megatron_counts(weights, n):
    """megatron-core's choices for samples 0..n-1 and the counts before each sample ``[n + 1, k]``."""
    w = np.asarray(normalised(weights))
    source, index = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    helpers_cpp.build_blending_indices(source, index, w, len(w), n, False)
    counts = np.zeros((n + 1, len(w)), dtype=np.int64)
    np.add.at(counts, (np.arange(1, n + 1), source), 1)
    return source, index, counts.cumsum(0)


@pytest.mark.parametrize("weights", [[0.3, 0.5, 0.2], [1, 1, 1], [3, 1], [0.7, 0.2, 0.05, 0.05],
                                     [0.533, 0.465, 0.002], [0.98, 0.01, 0.01], [0.40623, 0.2701, 0.32367],
                                     [0.31, 0.016, 0.155, 0.119, 0.201, 0.063, 0.05, 0.086]])
def test_blend_anchor_counts_equal_megatron_cores_far_into_the_stream(weights):
    """Placing sample n starts from a sample the rule forces, a few samples back (not from 0); its
    counts, and the choices after it, are megatron-core's (exact ties of rational weights included)."""
    n = 1_500_000
    source, index, counts = _megatron_counts(weights, n)
    rng = np.random.default_rng(0)
    w = np.asarray(normalised(weights))
    for at in [*range(0, 40), *rng.integers(40, n, 200).tolist(), n]:
        m, got = anchor_counts(w, at) or (0, np.zeros(len(w), dtype=np.int64))
        assert m <= at and np.array_equal(got, counts[m]), (at, m, got, counts[m])
        assert at - m < (200 if len(w) < 8 else 20_000), (at, m)  # a few samples back (thousands for 8 sources)
    for start in rng.integers(0, n - 3000, 20).tolist():
        got_source, got_index = BlendSchedule(weights).take(start, start + 3000)
        assert np.array_equal(got_source, source[start:start + 3000]), start
        assert np.array_equal(got_index, index[start:start + 3000]), start
    steps = BlendSchedule(weights)  # one rank's consecutive steps: 64 of 256 samples each, any distance apart
    for start in [700_000 + 256 * s + 64 for s in range(5)] + [10_000, 1_400_000]:
        assert np.array_equal(steps.take(start, start + 64)[0], source[start:start + 64]), start
        assert steps.counts_at(start + 80) == counts[start + 80].tolist()


def test_blend_without_an_anchor_walks_and_still_equals_megatron_core(monkeypatch):
    """16 sources of generic weights: no forced sample (they thin out as the sources grow), so placing
    a sample walks, from the schedule's place or from 0, within a bounded search."""
    from pretrain.data import blend

    weights = np.random.default_rng(16).dirichlet(np.ones(16)).tolist()
    n = 30_000
    source, index, counts = _megatron_counts(weights, n)
    monkeypatch.setattr(blend, "ANCHOR_SEARCH", 5000)
    assert anchor_counts(np.asarray(normalised(weights)), n - 1, lowest=n - 5000) is None
    s = BlendSchedule(weights)
    for start in (20_000, 25_000, 3_000, 29_000):  # ahead, ahead, back (from 0), ahead
        got = s.take(start, start + 500)
        assert np.array_equal(got[0], source[start:start + 500]) and np.array_equal(got[1], index[start:start + 500])


def _sources(tmp_path):
    """Three sources whose token ids tell them apart: source k holds ids k*80 .. k*80 + 79."""
    out = []
    for k, n in enumerate((3000, 2000, 4000)):
        ids = (np.arange(n) % 79 + k * 80).tolist()
        out.append(write_dataset(tmp_path / f"s{k}", [ids[i:i + 50] for i in range(0, n, 50)], 250,
                                 format="megatron" if k == 1 else "par"))  # either format in one blend
    return out


def test_blended_batches_follow_megatron_and_are_the_same_for_every_layout(tmp_path):
    datasets, weights = _sources(tmp_path), [0.3, 0.5, 0.2]
    kw = dict(seq_len=16, global_batch=8, seed=3, weights=weights)
    whole = TokenSampler(datasets, micro_batch=8, **kw)
    n = 8 * 20
    source, index = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    helpers_cpp.build_blending_indices(source, index, np.asarray(weights) / sum(weights), 3, n, False)
    for step in range(20):
        b = whole.global_train_batch(step)
        assert torch.equal(b.tokens[:, :-1] // 80, torch.from_numpy(source[step * 8:(step + 1) * 8]).long()[:, None]
                           .expand(8, 16))  # every sequence from the source megatron-core picks
        for dp in (2, 4):
            parts = [TokenSampler(datasets, micro_batch=1, dp_rank=r, dp_size=dp, **kw).train_batch(step)
                     for r in range(dp)]
            assert torch.equal(torch.cat([p.tokens.reshape(-1, 17) for p in parts]), b.tokens)
        counts = whole.source_samples(step + 1)
        assert all(abs(c - w * 8 * (step + 1)) < 1 for c, w in zip(counts, weights))  # within one sample
    resumed = TokenSampler(datasets, micro_batch=8, **kw)
    assert torch.equal(resumed.global_train_batch(13).tokens, whole.global_train_batch(13).tokens)
    # held out: each source's trailing 5%, blended by the same rule, windows in order
    assert [w.lo for w in whole.valid.windows] == [2850, 1900, 3800]
    e = whole.global_eval_batch(0).tokens
    assert torch.equal(e[:, 0] // 80, torch.from_numpy(source[:8]).long())
    assert torch.equal(e[0], torch.from_numpy(np.asarray(datasets[1].tokens[1900:1917], dtype=np.int64)))


def test_eval_path_is_a_held_out_set_of_its_own(tmp_path):
    train = write_dataset(tmp_path / "train", [list(range(1, 100))] * 20, 250, eos=249)
    held = write_dataset(tmp_path / "held", [[200 + i % 40 for i in range(300)]], 250, eos=249)
    cfg = load_config(None, [f"data.path={tmp_path / 'train'}", f"data.eval_path={tmp_path / 'held'}",
                             "train.seq_len=16", "model.vocab_size=250"])
    s = build_sampler(cfg, cfg.validate_world(1), 0)
    assert s.train_windows == (train.num_tokens - 1) // 16  # training takes every token
    e = s.global_eval_batch(0).tokens
    assert torch.equal(e[0], torch.from_numpy(np.asarray(held.tokens[:17], dtype=np.int64)))
    write_dataset(tmp_path / "other", [[1, 2, 3]] * 30, 300, eos=299)
    cfg = load_config(None, [f"data.path={tmp_path / 'train'}", f"data.eval_path={tmp_path / 'other'}",
                             "model.vocab_size=300"])
    with pytest.raises(UsageError, match="has vocab_size 300, EOS 299 but .*train has vocab_size 250, EOS 249"):
        build_sampler(cfg, cfg.validate_world(1), 0)


@pytest.mark.parametrize("overrides, message", [
    (['data.blend=[[1]]'], 'entry \\[1\\] must be \\[weight, "prefix"\\]'),
    (['data.blend=[[1, "a"], [2, "a"]]'], "names 'a' twice"),
    (['data.blend=[[1, "a"]]', "data.path=b"], "takes path or blend, not both"),
    (['data.blend=[[1, "a"], [inf, "b"]]'], "weight inf of 'b' must be a finite number > 0"),
    (["data.eval_path=a", 'data.eval_blend=[[1, "b"]]'], "takes eval_path or eval_blend, not both"),
])
def test_bad_blend_keys_are_one_line(overrides, message):
    with pytest.raises(UsageError, match=message):
        load_config(None, overrides)
    good = load_config(None, ['data.blend=[[3, "a"], [1, "b"]]'])
    assert good.data.train_sources == [[3.0, "a"], [1.0, "b"]]
