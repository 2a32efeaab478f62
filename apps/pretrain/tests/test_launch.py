"""Standalone launch: N local ranks with the torchrun environment; a raising rank ends all promptly."""

import sys
import textwrap
import time

import pytest

from pretrain.launch import RankFailed, check_nproc, launch
from pretrain.errors import UsageError

ENTRIES = '''
import os, time
import torch
import torch.distributed as dist
from pretrain.launch import init_distributed, shutdown

def report(scale):
    rank, world, local_rank, device = init_distributed(timeout_s=60)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out = (rank, world, local_rank, str(device), t.item() * scale, bool(os.environ["MASTER_ADDR"]))
    shutdown()
    return out

def one_rank_fails(stamp):
    rank, *_ = init_distributed(timeout_s=600)
    if rank == 1:
        time.sleep(0.5)
        with open(stamp, "w") as f:
            f.write(str(time.time()))
        raise ValueError("boom from rank 1")
    dist.barrier()  # would wait for the collective timeout (600 s) if the launcher did not stop it
'''


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    root = tmp_path_factory.mktemp("entries")
    (root / "launch_entries.py").write_text(textwrap.dedent(ENTRIES))
    sys.path.insert(0, str(root))  # spawned ranks inherit sys.path
    import launch_entries

    yield launch_entries
    sys.path.remove(str(root))


def test_standalone_ranks_see_the_torchrun_environment(entries):
    out = launch(entries.report, (2.0,), nproc=2)
    assert out == [(0, 2, 0, "cpu", 6.0, True), (1, 2, 1, "cpu", 6.0, True)]
    assert launch(entries.report, (1.0,), nproc=1) == [(0, 1, 0, "cpu", 1.0, True)]


def test_a_raising_rank_ends_every_rank_within_seconds_with_its_error(entries, tmp_path):
    stamp = tmp_path / "raised_at"
    with pytest.raises(RankFailed) as e:
        launch(entries.one_rank_fails, (str(stamp),), nproc=2)
    assert time.time() - float(stamp.read_text()) < 15  # rank 0 was stopped, not left in its barrier
    assert e.value.rank == 1 and str(e.value) == "rank 1 failed: ValueError: boom from rank 1"
    assert "launch_entries.py" in e.value.traceback


@pytest.mark.parametrize("nproc, message", [(0, "must be >= 1"), (65, "more than 64")])
def test_nproc_limits(nproc, message):
    with pytest.raises(UsageError, match=message):
        check_nproc(nproc, device="cpu")
