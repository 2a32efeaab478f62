"""Token dataset format, embedded data, and the deterministic dp-sharded sampler."""

import json

import numpy as np
import pytest
import torch

from pretrain.config import load_config
from pretrain.data import (TokenSampler, build_sampler, embedded_dataset, load_dataset, open_dataset,
                           write_dataset)
from pretrain.errors import UsageError


@pytest.fixture(scope="module")
def embedded():
    return embedded_dataset(seed=1234)


def test_format_round_trip_and_dtypes(tmp_path):
    docs = [[1, 2, 3], [4, 5], [6]]
    ds = write_dataset(tmp_path / "d", docs, vocab_size=300)
    assert ds.tokens.dtype == np.uint16 and list(ds.tokens) == [1, 2, 3, 4, 5, 6]
    assert list(ds.doc_offsets) == [0, 3, 5, 6] and ds.num_docs == 3
    big = write_dataset(tmp_path / "big", [[70000, 1]], vocab_size=100000)
    assert big.tokens.dtype == np.uint32 and list(open_dataset(str(tmp_path / "big") + ".bin").tokens) == [70000, 1]
    with pytest.raises(UsageError, match="outside the vocabulary of 300"):
        write_dataset(tmp_path / "x", [[300]], vocab_size=300)


def test_missing_or_malformed_files_are_usage_errors(tmp_path):
    write_dataset(tmp_path / "d", [[1, 2, 3], [4]], vocab_size=256)
    with pytest.raises(UsageError, match="is missing"):
        open_dataset(tmp_path / "nope")
    (tmp_path / "d.bin").write_bytes(b"\0" * 7)
    with pytest.raises(UsageError, match="the header says 4 tokens"):
        open_dataset(tmp_path / "d")
    write_dataset(tmp_path / "d", [[1, 2, 3], [4]], vocab_size=256)
    np.asarray([0, 3, 2], dtype="<i8").tofile(tmp_path / "d.idx")
    with pytest.raises(UsageError, match="offsets must rise"):
        open_dataset(tmp_path / "d")
    (tmp_path / "d.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        open_dataset(tmp_path / "d")
    (tmp_path / "d.json").write_text(json.dumps({"format": "par-tokens", "version": 1}))
    with pytest.raises(UsageError, match="lacks dtype"):
        open_dataset(tmp_path / "d")
    write_dataset(tmp_path / "e", [[1, 2]], 256)
    with pytest.raises(UsageError, match="vocab_size 256 > \\[model\\].vocab_size=100"):
        load_dataset(load_config(None, [f"data.path={tmp_path / 'e'}"]).data, 100)


def test_embedded_data_is_deterministic_and_learnable(embedded):
    again = embedded_dataset(seed=1234)
    assert np.array_equal(embedded.tokens, again.tokens)
    assert not np.array_equal(embedded_dataset(seed=7).tokens[:1000], embedded.tokens[:1000])
    assert embedded.num_tokens >= 1 << 20 and embedded.num_docs > 1000
    h1 = embedded.unigram_entropy()
    # the bigram conditional entropy, computed independently, is already far below the unigram's
    t = embedded.tokens.astype(np.int64)
    counts = np.zeros((256, 256))
    np.add.at(counts, (t[:-1], t[1:]), 1)
    cond = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    mask = counts > 0
    h2 = float(-(counts[mask] / counts.sum() * np.log(cond[mask])).sum())
    assert 2.8 < h1 < 3.4 and h2 < h1 - 0.9, (h1, h2)


def test_sampler_shards_global_batch_over_dp_and_is_a_function_of_step(embedded):
    ref = TokenSampler(embedded, seq_len=64, global_batch=8, micro_batch=8)
    for step in (0, 5, 123):
        whole = ref.global_train_batch(step).tokens
        parts = [TokenSampler(embedded, seq_len=64, global_batch=8, micro_batch=1, dp_rank=r, dp_size=4).train_batch(step)
                 for r in range(4)]
        assert parts[0].tokens.shape == (2, 1, 65)
        assert torch.equal(torch.cat([p.tokens.reshape(-1, 65) for p in parts]), whole)
        assert torch.equal(ref.train_batch(step).tokens[0], whole)
    fresh = TokenSampler(embedded, seq_len=64, global_batch=8, micro_batch=8)
    assert torch.equal(fresh.train_batch(123).tokens, ref.train_batch(123).tokens)  # resume = the step alone
    assert not torch.equal(ref.train_batch(1).tokens, ref.train_batch(2).tokens)


def test_windows_are_contiguous_tokens_with_document_segments(embedded):
    s = TokenSampler(embedded, seq_len=64, global_batch=8, micro_batch=8)
    b = s.global_train_batch(3)
    stream = torch.from_numpy(embedded.tokens.astype(np.int64))
    offsets = embedded.doc_offsets
    for row, seg in zip(b.tokens, b.segments):
        start = int(np.flatnonzero(
            np.lib.stride_tricks.sliding_window_view(embedded.tokens[: s.split_at], 65)[::64].astype(np.int64)
            .__eq__(row.numpy()).all(1))[0]) * 64
        assert torch.equal(stream[start:start + 65], row)
        starts_inside = [o - start for o in offsets if start < o < start + 65]
        assert torch.equal(torch.nonzero(seg.diff()).flatten() + 1, torch.tensor(starts_inside, dtype=torch.long))
        assert seg[0] == 0 and s.split_at > start + 64  # training windows never reach the held-out tail
    assert torch.equal(b.inputs, b.tokens[:, :-1]) and torch.equal(b.labels, b.tokens[:, 1:])


def test_epochs_cover_every_window_once(tmp_path):
    ds = write_dataset(tmp_path / "s", [list(range(1, 200))], vocab_size=256)
    s = TokenSampler(ds, seq_len=4, global_batch=2, micro_batch=2, valid_fraction=0.1)
    n = s.train_windows
    firsts = torch.cat([s.global_train_batch(i).tokens[:, 0] for i in range(n // 2)])
    # token at position p is p + 1, so window w starts with 4w + 1: one epoch visits distinct windows
    assert len(set(firsts.tolist())) == len(firsts) and all((x - 1) % 4 == 0 for x in firsts.tolist())
    assert max(firsts.tolist()) <= 4 * (n - 1) + 1


def test_eval_batches_come_from_the_held_out_tail(embedded):
    s = TokenSampler(embedded, seq_len=64, global_batch=8, micro_batch=2, dp_rank=1, dp_size=2)
    e = s.eval_batch(0)
    assert e.tokens.shape == (2, 2, 65)
    whole = s.global_eval_batch(0).tokens
    tail = torch.from_numpy(embedded.tokens[s.split_at:s.split_at + 65].astype(np.int64))
    assert torch.equal(whole[0], tail) and torch.equal(e.tokens.reshape(-1, 65), whole[4:])
    assert s.held_out == "the last 5 % of each source's tokens ([data].valid_fraction)"  # the eval line says so
    separate = TokenSampler(embedded, seq_len=64, global_batch=8, micro_batch=2, eval_datasets=[embedded])
    assert separate.held_out == "the separate eval set ([data].eval_path / eval_blend)"


def test_build_sampler_from_config_and_too_small_data(tmp_path):
    cfg = load_config(None, ["parallel.pp=2"])
    layout = cfg.validate_world(4)
    s = build_sampler(cfg, layout, dp_rank=1)
    assert s.train_batch(0).tokens.shape == (4, 1, 65)
    write_dataset(tmp_path / "small", [[1] * 50], vocab_size=256)
    with pytest.raises(UsageError, match="too few"):
        build_sampler(load_config(None, [f"data.path={tmp_path / 'small'}"]), layout, 0)


def test_embedded_data_with_eos_ends_every_document_with_256():
    plain, packed = embedded_dataset(seed=3, num_tokens=5000), embedded_dataset(seed=3, num_tokens=5000, eos=True)
    assert packed.eos == 256 and packed.vocab_size == 257 and plain.eos is None
    ends = packed.doc_offsets[1:] - 1
    assert np.all(packed.tokens[ends] == 256) and np.sum(packed.tokens == 256) == packed.num_docs
    assert np.array_equal(np.delete(packed.tokens, ends), plain.tokens)  # the same text, plus the separators


def test_document_keys_need_a_dataset_with_eos(tmp_path):
    write_dataset(tmp_path / "old", [[1, 2, 3]] * 50, vocab_size=256)  # as written before EOS existed
    for key in ("document_mask", "reset_position_ids", "eod_mask_loss"):
        cfg = load_config(None, [f"data.path={tmp_path / 'old'}", f"data.{key}=true"])
        with pytest.raises(UsageError, match="has no EOS between documents"):
            load_dataset(cfg.data, 256)
    assert load_dataset(load_config(None, [f"data.path={tmp_path / 'old'}"]).data, 256).eos is None
    with pytest.raises(UsageError, match="smaller than the embedded byte-level data's 257"):
        load_config(None, ["data.document_mask=true", "model.vocab_size=256"])
    assert load_dataset(load_config(None, ["data.document_mask=true", "model.vocab_size=257"]).data, 257).eos == 256


def test_megatron_split_cuts_train_valid_and_test_parts_in_order(tmp_path):
    """[data].split = [949, 50, 1] as Megatron's --split: each source's first 94.9 % trains, the next 5 %
    validates, the last 0.1 % tests; the test part is read only by test batches."""
    ds = write_dataset(tmp_path / "d", [list(range(1, 200))] * 50, vocab_size=256)  # 9950 tokens
    cfg = load_config(None, [f"data.path={tmp_path / 'd'}", "data.split=[900, 80, 20]", "train.seq_len=8"])
    assert cfg.data.held_out == (0.08, 0.02)
    s = build_sampler(cfg, cfg.validate_world(1), 0, ds)
    n = ds.num_tokens
    train_end, valid_end = round(n * 0.9), n - round(n * 0.02)
    assert s.split_at == train_end
    starts = lambda stream, k: {int(x) for x in stream.windows[0].starts(np.arange(k))}  # noqa: E731
    assert max(starts(s.train, s.train_windows)) + 9 <= train_end
    valid, test = starts(s.valid, s.valid_windows), starts(s.test, s.test.windows[0].count)
    assert min(valid) == train_end and max(valid) + 9 <= valid_end and min(test) == valid_end and max(test) + 9 <= n
    assert torch.equal(s.eval_batch(0, "test").tokens[0, 0], torch.from_numpy(ds.tokens[valid_end:valid_end + 9].astype(np.int64)))
    plain = build_sampler(load_config(None, [f"data.path={tmp_path / 'd'}", "train.seq_len=8"]),
                          cfg.validate_world(1), 0, ds)
    assert plain.test is None and plain.split_at == round(n * 0.95)  # without split: as before


@pytest.mark.parametrize("split, words", [("[1, 1]", "must be three weights"), ("[1, 0, 1]", "train and valid > 0"),
                                          ("[-1, 5, 1]", "must be three weights")])
def test_a_bad_split_is_one_line(split, words):
    with pytest.raises(UsageError, match=r"\[data\].split=.*" + words):
        load_config(None, [f"data.split={split}"])
