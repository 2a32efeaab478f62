"""Checks made before any rank trains, so a user's mistake is one line and exit 2 at any ``--nproc``
(not a rank's traceback, nor an error at the first save minutes later).

The run lock (one run per ``[log].dir`` and per checkpoint directory) is :mod:`pretrain.runtime.run_lock`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..errors import UsageError
from ..runtime.run_lock import PID_FILE, run_lock  # noqa: F401 - the launcher takes the lock from here


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.log.dir) / "checkpoints")


def check_run(cfg, layout, force: bool = False) -> None:
    """Data, checkpoints to start from, the checkpoint directory's owner, then writable directories."""
    from ..checkpoint.retention import check_unclaimed, read_manifest
    from ..checkpoint.safe_metadata import read_metadata
    from ..checkpoint.compatible import check_compatible, check_optimizer_matches
    from ..checkpoint.store import read_state, resolve_checkpoint
    from ..checkpoint.hf_data import check_data_matches_import
    from ..data import members, build_sampler, check_data_ids, load_dataset, load_eval

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
    latest = _latest_to_check(root, ck.fallback, ck.verify) if ck.resume else None
    start = latest or (resolve_checkpoint(ck.init_from) if ck.init_from else None)
    if latest is None and start is not None:  # init_from: its index files checked as a resume's are
        from ..checkpoint.integrity import METADATA, read_checksums, verify_files
        from ..checkpoint.retention import STATE_FILE

        verify_files(start, [STATE_FILE, METADATA], read_checksums(start, ck.verify))
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
    if cfg.log.flight_records:  # every rank writes its record there: a file or a read-only mount fails them all
        _check_flight_dir(Path(cfg.log.dir))


def _check_flight_dir(log_dir: Path) -> None:
    from ..runtime.hang import FLIGHT_DIR

    flight = log_dir / FLIGHT_DIR
    if flight.is_symlink():
        raise UsageError(f"{str(flight)!r} is a symlink; the ranks write their flight records there and follow no "
                         f"symlink in [log].dir: remove it, or set [log].flight_records = 0")
    check_writable(flight, "the flight-record directory ([log].flight_records)")


def _latest_to_check(root: Path, fallback: bool, verify: bool):
    """``latest``, its small index files checked (a damaged one: exit 2 here); None when it is damaged
    and ``fallback`` lets the ranks take an older one."""
    from ..checkpoint.integrity import METADATA, DamagedCheckpoint, read_checksums, verify_files
    from ..checkpoint.resume import with_fallback_hint
    from ..checkpoint.retention import STATE_FILE
    from ..checkpoint.safe_metadata import read_metadata
    from ..checkpoint.store import latest_checkpoint

    try:
        latest = latest_checkpoint(root)
        if latest is not None:
            verify_files(latest, [STATE_FILE, METADATA], read_checksums(latest, verify))
            read_metadata(latest)  # a crafted index, or a missing or truncated data file
        return latest
    except DamagedCheckpoint as e:
        if not fallback:
            raise with_fallback_hint(e) from None
        return None


def _check_wandb() -> None:
    """[log] wandb needs the optional package: one line before any rank starts, not rank 0's error."""
    import importlib.util

    from ..observe.metrics import WANDB_MISSING

    if importlib.util.find_spec("wandb") is None:
        raise UsageError(WANDB_MISSING)
    if not _wandb_can_log():
        raise UsageError("[log].wandb = true but no W&B API key is configured (no WANDB_API_KEY, no `wandb login` "
                         "in ~/.netrc): log in with `wandb login`, or set WANDB_MODE=offline to keep the run on disk "
                         "(`wandb sync` uploads it later)")


def _wandb_can_log() -> bool:
    """Offline/disabled W&B needs no key; online needs WANDB_API_KEY or a netrc entry for the W&B host."""
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled") or \
            os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_writable(path: Path, what: str) -> None:
    """Create ``path`` if needed and prove a file (of a MiB: a full disk refuses it) can be written in it."""
    from ..checkpoint.faults import PROBE_BYTES, cannot_write_here

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"{what} {str(path)!r} is not a writable directory ({e.strerror or e})") from None
    if cannot_write_here(path):
        raise UsageError(f"{what} {str(path)!r} is on a full disk (no room for {PROBE_BYTES >> 20} MiB); free space "
                         f"there or choose another directory")
