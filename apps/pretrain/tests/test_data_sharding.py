"""Each dp rank reads only its own share of a step from the memory map, and the next step's share
is read in the background (pinned only for a CUDA device)."""

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from pretrain.data import TokenSampler, write_dataset
from pretrain.data.prefetch import Prefetcher
from pretrain.data.sampler import Batch


class CountingTokens:
    """A dataset's token array that counts the tokens read through it."""

    def __init__(self, tokens):
        self.tokens, self.read = tokens, 0

    @property
    def shape(self):
        return self.tokens.shape

    @property
    def dtype(self):
        return self.tokens.dtype

    def __getitem__(self, key):
        out = self.tokens[key]
        self.read += int(np.size(out))
        return out


def _counted(tmp_path, sources):
    out = []
    for k in range(sources):
        ds = write_dataset(tmp_path / f"s{k}", [list(range(1 + k, 200 + k))] * 60, vocab_size=256)
        assert isinstance(ds.tokens, np.memmap)
        out.append(replace(ds, tokens=CountingTokens(ds.tokens)))
    return out


@pytest.mark.parametrize("sources", [1, 3])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_dp_rank_reads_only_its_share_of_the_step(tmp_path, dp, sources):
    seq_len, global_batch = 32, 16
    datasets = _counted(tmp_path, sources)
    weights = [0.5, 0.3, 0.2][:sources] if sources > 1 else None
    whole = TokenSampler([replace(d, tokens=d.tokens.tokens) for d in datasets], seq_len=seq_len,
                         global_batch=global_batch, micro_batch=1, weights=weights)
    for step in (0, 7, 100_000):
        parts = []
        for rank in range(dp):
            for d in datasets:
                d.tokens.read = 0
            s = TokenSampler(datasets if sources > 1 else datasets[0], seq_len=seq_len, global_batch=global_batch,
                             micro_batch=2, dp_rank=rank, dp_size=dp, weights=weights)
            parts.append(s.train_batch(step).tokens.reshape(-1, seq_len + 1))
            assert sum(d.tokens.read for d in datasets) == global_batch // dp * (seq_len + 1), (step, rank)
        assert torch.equal(torch.cat(parts), whole.global_train_batch(step).tokens)  # and they make the step


def _batch(step):
    return Batch(torch.full((2, 1, 5), step, dtype=torch.int64), torch.zeros(2, 1, 5, dtype=torch.int32))


def test_prefetcher_reads_the_next_step_in_the_background_and_keeps_cpu_tensors_as_read():
    reads, made = [], {}

    def read(step):
        reads.append((step, threading.current_thread().name))
        made[step] = _batch(step)
        return made[step]

    p = Prefetcher(read, torch.device("cpu"))
    first = p.get(0)
    assert first is made[0] and reads[0] == (0, threading.current_thread().name)
    second = p.get(1)  # read in the background during step 0
    assert second is made[1] and reads[1][0] == 1 and reads[1][1].startswith("prefetch")
    assert not second.tokens.is_pinned()  # a CPU run: not pinned, the very tensors read
    jumped = p.get(9)  # a resume elsewhere: read now, then 10 in the background
    main = threading.current_thread().name
    assert jumped is made[9] and (9, main) in reads  # 2 (read or cancelled in time) is dropped
    assert p.get(10) is made[10] and (10, main) not in reads and reads.count((9, main)) == 1
    p.close()


def test_prefetcher_pins_every_tensor_for_a_cuda_device(monkeypatch):
    """The CUDA path on a CPU-only machine: pin_memory is called on the reader's thread for each tensor."""
    pinned = []

    def fake_pin(self):
        pinned.append(threading.current_thread().name)
        return self.clone()

    devices = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices.append((threading.current_thread().name, d)))
    gate = threading.Event()  # step 2 (read in the background during step 1) waits here: pinned is exact

    def read(step):
        if step >= 2:
            gate.wait()
        return _batch(step)

    p = Prefetcher(read, torch.device("cuda", 3))
    p.get(0)
    b = p.get(1)
    assert torch.equal(b.tokens, _batch(1).tokens)
    # step 0 read (and pinned) now on the caller's thread, step 1 on the reader's: two tensors each
    assert pinned[:2] == ["MainThread"] * 2 and len(pinned) == 4, pinned
    assert all(name.startswith("prefetch") for name in pinned[2:]), pinned
    # the reader's thread works on this rank's GPU (the current device is per thread; default GPU 0)
    assert any(name.startswith("prefetch") and d == torch.device("cuda", 3) for name, d in devices), devices
    gate.set()
    p.close()
