"""The disk-full test of a save failure: ENOSPC found in DCP's wrapped exceptions, torch's short
write (its zip writer loses the errno), or a filesystem that refuses another MiB. The second half needs a small
tmpfs (root); elsewhere it is skipped and the non-full answer is still checked."""

import errno
import subprocess

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.checkpoint.faults import PROBE_BYTES, cannot_write_here, disk_full


def test_enospc_is_found_inside_dcp_failures_and_causes():
    inner = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = inner
    assert disk_full(CheckpointException("save", {3: (wrapped, None)}))
    assert not disk_full(CheckpointException("save", {3: (RuntimeError("file not found in archive"), None)}))
    assert not disk_full(OSError(errno.EIO, "I/O error"))


def test_a_dcp_failure_is_named_by_its_first_ranks_error_in_one_line():  # issue 40: was every rank's traceback
    from pretrain.checkpoint.faults import first_failure

    error = CheckpointException("load", {1: (RuntimeError("b"), None), 0: (ValueError("short read\n  at ..."), None)})
    assert first_failure(error) == "rank 0: ValueError: short read"
    assert first_failure(RuntimeError("one\ntwo")) == "RuntimeError: one"


def test_torchs_short_write_without_errno_counts_as_full():  # what CI's 2 MiB tmpfs raised
    short = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")
    assert disk_full(CheckpointException("save", {0: (short, None)}))


def test_a_directory_with_room_is_not_full_and_the_probe_is_removed(tmp_path):
    assert not cannot_write_here(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 1 MiB tmpfs with half a probe's room left (needs root; skipped elsewhere)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        (small / "filler").write_bytes(bytes(PROBE_BYTES // 2))
        yield small
    finally:
        subprocess.run(["umount", str(small)])


def test_a_full_tmpfs_refuses_the_probe(full_tmpfs):
    assert cannot_write_here(full_tmpfs)
    assert sorted(p.name for p in full_tmpfs.iterdir()) == ["filler"]


def test_a_log_dir_on_a_full_disk_is_one_line_before_launch(full_tmpfs):  # issue 40: was OSError, exit 1
    from typer.testing import CliRunner

    from pretrain.cli import app

    res = CliRunner().invoke(app, ["train", "--nproc", "1", "--set", "train.steps=1", "--set", "train.warmup_steps=0",
                                  "--set", f"log.dir={full_tmpfs / 'run'}"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "is on a full disk" in res.stderr, res.output
