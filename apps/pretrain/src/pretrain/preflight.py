"""Checks made before any rank trains, so a user's mistake is one line and exit 2 at any ``--nproc``
(not a rank's traceback, nor an error at the first save minutes later).

Also the run lock: one run per ``[log].dir`` (a second one refuses, naming the first one's PID).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import UsageError

PID_FILE = "pretrain.pid"


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.log.dir) / "checkpoints")


def check_run(cfg, layout, force: bool = False) -> None:
    """Data, checkpoints to start from, the checkpoint directory's owner, then writable directories."""
    from .checkpoint.retention import check_unclaimed
    from .checkpoint.store import (check_compatible, check_optimizer_matches, latest_checkpoint, read_state,
                                   resolve_checkpoint)
    from .data import build_sampler, check_token_ids, load_dataset

    if cfg.log.wandb:
        _check_wandb()
    dataset = load_dataset(cfg.data, cfg.model.vocab_size)
    check_token_ids(dataset, cfg.model.vocab_size)
    build_sampler(cfg, layout, 0, dataset)  # too small for the windows: UsageError now, not in the ranks
    ck, root = cfg.checkpoint, checkpoint_root(cfg)
    latest = latest_checkpoint(root) if ck.resume else None
    start = latest or (resolve_checkpoint(ck.init_from) if ck.init_from else None)
    if start is not None:
        check_compatible(start, read_state(start), cfg)
    if latest is not None and read_state(latest).get("optimizer", False):  # resuming loads the optimizer's state
        check_optimizer_matches(latest, read_state(latest), cfg)
    if not ck.resume and not force:
        check_unclaimed(root)
    check_writable(Path(cfg.log.dir), "[log].dir")
    check_writable(root, "[checkpoint].dir")


def _check_wandb() -> None:
    """[log] wandb needs the optional package: one line before any rank starts, not rank 0's error."""
    import importlib.util

    from .metrics import WANDB_MISSING

    if importlib.util.find_spec("wandb") is None:
        raise UsageError(WANDB_MISSING)


def check_writable(path: Path, what: str) -> None:
    """Create ``path`` if needed and prove a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"{what} {str(path)!r} is not a writable directory ({e.strerror or e})") from None


@contextmanager
def run_lock(log_dir: str | Path):
    """Hold a lock on ``log_dir`` for the run; another live run holding it is a UsageError naming its PID.

    The lock is on the directory itself (released by the kernel when the process dies); the holder's
    PID is in ``pretrain.pid`` while it runs."""
    path = Path(log_dir)
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
            raise UsageError(f"{log_dir} is in use by another run (PID {holder}); wait for it to end, or choose "
                             f"another --set log.dir") from None
        (path / PID_FILE).write_text(f"{os.getpid()}\n")
        try:
            yield
        finally:
            (path / PID_FILE).unlink(missing_ok=True)
    finally:
        os.close(fd)
