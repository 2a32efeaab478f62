"""Checks made before any rank trains, so a user's mistake is one line and exit 2 at any ``--nproc``
(not a rank's traceback, nor an error at the first save minutes later).

Also the run lock: one run per ``[log].dir`` and per checkpoint directory (a second one refuses,
naming the first one's PID).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .errors import UsageError

PID_FILE = "pretrain.pid"


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.log.dir) / "checkpoints")


def check_run(cfg, layout, force: bool = False) -> None:
    """Data, checkpoints to start from, the checkpoint directory's owner, then writable directories."""
    from .checkpoint.retention import check_unclaimed, read_manifest
    from .checkpoint.safe_metadata import read_metadata
    from .checkpoint.store import check_compatible, check_optimizer_matches, read_state, resolve_checkpoint
    from .checkpoint.hf_data import check_data_matches_import
    from .data import members, build_sampler, check_data_ids, load_dataset, load_eval

    for key, path in (("[log].dir", Path(cfg.log.dir)), ("[checkpoint].dir", checkpoint_root(cfg))):
        if path.resolve() == Path(path.resolve().anchor):
            raise UsageError(f"{key} {str(path)!r} is the filesystem root; give a directory for this run, "
                             f"e.g. --set log.dir=runs/a")
    if cfg.log.wandb:
        _check_wandb()
    dataset = load_dataset(cfg.data, cfg.model.vocab_size)
    check_data_ids(dataset, cfg.model.vocab_size)
    check_data_ids(load_eval(cfg.data, cfg.model.vocab_size, dataset), cfg.model.vocab_size)
    build_sampler(cfg, layout, 0, dataset)  # too small for the windows: UsageError now, not in the ranks
    ck, root = cfg.checkpoint, checkpoint_root(cfg)
    latest = _latest_to_check(root, ck.fallback) if ck.resume else None
    start = latest or (resolve_checkpoint(ck.init_from) if ck.init_from else None)
    if start is not None:
        check_compatible(start, read_state(start), cfg)
    if latest is None and start is not None:  # an imported model: data of its own tokenizer
        check_data_matches_import(read_state(start), members(dataset), cfg.model.vocab_size)
    if latest is None and start is not None:
        read_metadata(start)  # a crafted index, or a missing or truncated data file: one line here
    if latest is not None and read_state(latest).get("optimizer", False):  # resuming loads the optimizer's state
        check_optimizer_matches(latest, read_state(latest), cfg)
    read_manifest(root)  # names in it that would leave the directory: refused before any save prunes
    if not ck.resume and not force:
        check_unclaimed(root)
    check_writable(Path(cfg.log.dir), "[log].dir")
    check_writable(root, "[checkpoint].dir")


def _latest_to_check(root: Path, fallback: bool):
    """``latest``, its small index files checked (a damaged one: exit 2 here); None when it is damaged
    and ``fallback`` lets the ranks take an older one."""
    from .checkpoint.integrity import METADATA, DamagedCheckpoint, read_checksums, verify_files
    from .checkpoint.resume import with_fallback_hint
    from .checkpoint.retention import STATE_FILE
    from .checkpoint.safe_metadata import read_metadata
    from .checkpoint.store import latest_checkpoint

    try:
        latest = latest_checkpoint(root)
        if latest is not None:
            verify_files(latest, [STATE_FILE, METADATA], read_checksums(latest))
            read_metadata(latest)  # a crafted index, or a missing or truncated data file
        return latest
    except DamagedCheckpoint as e:
        if not fallback:
            raise with_fallback_hint(e) from None
        return None


def _check_wandb() -> None:
    """[log] wandb needs the optional package: one line before any rank starts, not rank 0's error."""
    import importlib.util

    from .metrics import WANDB_MISSING

    if importlib.util.find_spec("wandb") is None:
        raise UsageError(WANDB_MISSING)


def check_writable(path: Path, what: str) -> None:
    """Create ``path`` if needed and prove a file (of a MiB: a full disk refuses it) can be written in it."""
    from .checkpoint.faults import PROBE_BYTES, cannot_write_here

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"{what} {str(path)!r} is not a writable directory ({e.strerror or e})") from None
    if cannot_write_here(path):
        raise UsageError(f"{what} {str(path)!r} is on a full disk (no room for {PROBE_BYTES >> 20} MiB); free space "
                         f"there or choose another directory")


@contextmanager
def run_lock(*dirs: str | Path):
    """Hold a lock on each of ``dirs`` (log and checkpoint directory) for the run; another live run
    holding one is a UsageError naming its PID.

    The lock is on the directory itself (released by the kernel when the process dies); the holder's
    PID is in ``pretrain.pid`` while it runs."""
    with ExitStack() as stack:
        for path in dict.fromkeys(Path(d).resolve() for d in dirs):  # the same directory twice: one lock
            stack.enter_context(_lock_dir(path))
        yield


@contextmanager
def _lock_dir(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = (path / PID_FILE).read_text().strip()
            except OSError:
                holder = "?"
            raise UsageError(f"{path} is in use by another run (PID {holder}); wait for it to end, or choose "
                             f"another --set log.dir / checkpoint.dir") from None
        (path / PID_FILE).write_text(f"{os.getpid()}\n")
        try:
            yield
        finally:
            (path / PID_FILE).unlink(missing_ok=True)
    finally:
        os.close(fd)
