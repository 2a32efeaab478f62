"""What a checkpoint's bytes should be: ``checksums.json``, and the checks made against it.

At save, each rank hashes the bytes of its DCP data files ``__R_<i>.distcp`` as DCP writes them
(:class:`.hashing_writer.HashingWriter`: no second pass over the files; in the background thread for an async
save) and its small ``rng/rank_R.pt``; rank 0 adds ``.metadata`` and ``trainer_state.json`` and
writes ``checksums.json`` into ``step_N.tmp`` last, before the rename: a directory named ``step_N``
carries the size and SHA-256 of every other file in it.

On load a rank checks only the files it is about to read (the data files its load plan touches,
its RNG file, the two small index files), so a resharded load stays as cheap as the load itself.
:class:`.checked_reader.CheckedReader` reads each data file once, front to back, hashing every byte while the
items its plan needs are deserialised from what was read (the file is not read a second time to
be checked); a mismatch is found when the file's last byte is hashed, before the load returns, and
is a :class:`DamagedCheckpoint`, one line naming the file (so is bytes DCP cannot deserialise,
when they do not match either). ``pretrain verify`` checks every file. A checkpoint written before
checksums existed has none: it loads (and says so) with its sizes checked against the extents its
``.metadata`` records.

SHA-256 because it is the fastest hash in the standard library on this hardware (SHA extensions;
measured in the README); the name of the algorithm is stored, so another can follow.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import DamagedCheckpoint, damaged, shown
from ..runtime.strict_json import loads
from .retention import STATE_FILE, read_state, write_atomic
from .safe_metadata import SafeReader

CHECKSUMS = "checksums.json"
METADATA = ".metadata"
ALGORITHM = "sha256"


DATA_SUFFIX = ".distcp"  # DCP's data files: hashed as they are written and as they are read
HASH_BLOCK = 16 << 20  # bytes hashed per call on load


def new_hash(file: Path):
    """A fresh hasher for the bytes of ``file``: every file hashed, at save, load or verify, starts here."""
    return hashlib.new(ALGORITHM)


def digest(file: Path) -> dict:
    """``{"size": bytes, "sha256": hex}`` of ``file``."""
    with open(file, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, ALGORITHM: hashlib.file_digest(f, lambda: new_hash(file)).hexdigest()}


def digests(root: Path, names: list[str]) -> dict[str, dict]:
    return {name: digest(root / name) for name in names}


def write_checksums(tmp: Path, entries: dict[str, dict]) -> None:
    """Rank 0, last before the rename: the ranks' ``entries`` plus the index files, into ``checksums.json``."""
    entries = entries | digests(tmp, [n for n in (METADATA, STATE_FILE) if (tmp / n).is_file()])
    write_atomic(tmp / CHECKSUMS, json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(entries.items()))},
                                             indent=1) + "\n")


def read_checksums(path: Path, required: bool = False) -> dict[str, dict] | None:
    """The recorded ``{file: {"size", "sha256"}}`` of checkpoint ``path``; None if it has none (written
    before checksums existed), which is damage when ``required`` (``[checkpoint].verify``, on by default)."""
    try:
        data = loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        if required:
            raise damaged(path, f"{CHECKSUMS} is missing, so its files cannot be verified (a checkpoint written "
                                f"before checksums existed loads with [checkpoint].verify = false)") from None
        return None
    except (OSError, ValueError) as e:
        raise damaged(path, f"{CHECKSUMS} is unreadable ({e})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or data.get("algorithm") != ALGORITHM or not all(
            isinstance(v, dict) and _is_size(v.get("size")) and isinstance(v.get(ALGORITHM), str)
            for v in files.values()):
        raise damaged(path, f"{CHECKSUMS} is not a {ALGORITHM} file list")
    for name in files:
        if not _is_inside(name):
            raise damaged(path, f"{CHECKSUMS} names {shown(name)}, which is not a file inside the checkpoint")
    return files


def _is_size(size) -> bool:
    return isinstance(size, int) and not isinstance(size, bool) and size >= 0


def _is_inside(name: str) -> bool:
    """A relative name of a file below the checkpoint: no absolute path, no '..', '.', empty part or NUL."""
    parts = name.split("/")
    return bool(name) and "\\" not in name and "\0" not in name and all(p not in ("", ".", "..") for p in parts)


def check_listed(path: Path, name: str, checksums: dict[str, dict]) -> int:
    """DamagedCheckpoint if ``name`` is not listed, leads outside ``path``, is missing or of the wrong
    size (everything but its bytes); returns its size."""
    want = checksums.get(name)
    if want is None:
        raise damaged(path, f"{name} is not in its {CHECKSUMS}")
    file = path / name
    if not file.resolve().is_relative_to(path.resolve()):  # a symlink out of the checkpoint
        raise damaged(path, f"{name} leads outside the checkpoint")
    if not file.is_file():
        raise damaged(path, f"{name} is missing")
    size = file.stat().st_size
    if size != want["size"]:
        raise damaged(path, f"{name} has {size} bytes, {want['size']} were written")
    return size


def mismatch(path: Path, name: str) -> DamagedCheckpoint:
    return damaged(path, f"{name} does not match its {ALGORITHM} checksum")


def verify_files(path: Path, names, checksums: dict[str, dict] | None) -> int:
    """DamagedCheckpoint naming the first of ``names`` that is missing, of the wrong size or bytes; returns
    the bytes checked. Without ``checksums`` (an older checkpoint) nothing is checked here."""
    if checksums is None:
        return 0
    total = 0
    for name in sorted(names):
        size = check_listed(path, name, checksums)
        if digest(path / name)[ALGORITHM] != checksums[name][ALGORITHM]:
            raise mismatch(path, name)
        total += size
    return total


def verify_checkpoint(path: Path) -> tuple[bool, str]:
    """Check every file of checkpoint ``path`` (``pretrain verify``): (whether its bytes were verified, a
    one-line summary), or DamagedCheckpoint.

    Without checksums (an older checkpoint) only what can be: its index reads and its data files
    hold the extents it records; its bytes are not verified (False)."""
    checksums = read_checksums(path)
    checked = verify_files(path, checksums or [STATE_FILE, METADATA], checksums)
    read_state(path)  # a pretrain checkpoint at all
    storage = SafeReader(str(path)).read_metadata().storage_data
    data = {info.relative_path for info in storage.values()}
    if checksums is None:  # SafeReader checked the data files' extents
        return False, (f"checkpoint {path} is not verified: it has no {CHECKSUMS} (deleted, or written before "
                       f"checkpoints carried checksums); its {len(data)} data files are present and long enough, "
                       f"their bytes cannot be checked")
    unlisted = sorted(data - checksums.keys())
    if unlisted:
        raise damaged(path, f"{unlisted[0]} is not in its {CHECKSUMS}")
    return True, f"{path}: {len(checksums)} files, {checked / 1e6:.1f} MB match their {ALGORITHM} checksums"


def first_damage(error: BaseException) -> DamagedCheckpoint | None:
    """The lowest rank's DamagedCheckpoint inside DCP's CheckpointException (every rank gets all ranks')."""
    for _, failure in sorted(getattr(error, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, DamagedCheckpoint):
            return exc
    return None


_HASHER: list = []
_HASHER_LOCK = threading.Lock()


def hasher_thread():
    """The one helper thread that hashes a save's large writes while they are written, and a load's files
    while they are deserialised (started on first use)."""
    with _HASHER_LOCK:
        if not _HASHER:
            _HASHER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash"))
        return _HASHER[0]
