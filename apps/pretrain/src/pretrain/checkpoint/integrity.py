"""What a checkpoint's bytes should be: ``checksums.json``, and the checks made against it.

At save, each rank hashes the bytes of its DCP data files ``__R_<i>.distcp`` as DCP writes them
(:class:`HashingWriter`: no second pass over the files; in the background thread for an async
save) and its small ``rng/rank_R.pt``; rank 0 adds ``.metadata`` and ``trainer_state.json`` and
writes ``checksums.json`` into ``step_N.tmp`` last, before the rename: a directory named ``step_N``
carries the size and SHA-256 of every other file in it.

On load a rank checks only the files it is about to read (the data files its load plan touches,
its RNG file, the two small index files), so a resharded load stays as cheap as the load itself.
:class:`CheckedReader` reads each data file once, front to back, hashing every byte while the
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

import contextlib
import hashlib
import io
import json
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ..errors import DamagedCheckpoint, damaged
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
        data = json.loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        if required:
            raise damaged(path, f"{CHECKSUMS} is missing, so its files cannot be verified (a checkpoint written "
                                f"before checksums existed loads with [checkpoint].verify = false)") from None
        return None
    except (OSError, ValueError) as e:
        raise damaged(path, f"{CHECKSUMS} is unreadable ({e})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if data.get("algorithm") != ALGORITHM or not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get(ALGORITHM), str)
            for v in files.values()):
        raise damaged(path, f"{CHECKSUMS} is not a {ALGORITHM} file list")
    for name in files:
        if not _is_inside(name):
            raise damaged(path, f"{CHECKSUMS} names {name!r}, which is not a file inside the checkpoint")
    return files


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


def _mismatch(path: Path, name: str) -> DamagedCheckpoint:
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
            raise _mismatch(path, name)
        total += size
    return total


def verify_checkpoint(path: Path) -> str:
    """Check every file of checkpoint ``path`` (``pretrain verify``): a one-line summary, or DamagedCheckpoint.

    Without checksums (an older checkpoint) only what can be: its index reads and its data files
    hold the extents it records."""
    checksums = read_checksums(path)
    checked = verify_files(path, checksums or [STATE_FILE, METADATA], checksums)
    read_state(path)  # a pretrain checkpoint at all
    storage = SafeReader(str(path)).read_metadata().storage_data
    data = {info.relative_path for info in storage.values()}
    if checksums is None:  # SafeReader checked the data files' extents
        return (f"{path}: no {CHECKSUMS} (written before checkpoints carried checksums): its {len(data)} data "
                f"files are present and long enough, their bytes are not verified")
    unlisted = sorted(data - checksums.keys())
    if unlisted:
        raise damaged(path, f"{unlisted[0]} is not in its {CHECKSUMS}")
    return f"{path}: {len(checksums)} files, {checked / 1e6:.1f} MB match their {ALGORITHM} checksums"


def first_damage(error: BaseException) -> DamagedCheckpoint | None:
    """The lowest rank's DamagedCheckpoint inside DCP's CheckpointException (every rank gets all ranks')."""
    for _, failure in sorted(getattr(error, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, DamagedCheckpoint):
            return exc
    return None


class _HashingStream:
    """A binary file being written whose bytes are hashed on their way to it (a large write's bytes
    hashed in the helper thread while the file takes them: both release the GIL)."""

    def __init__(self, raw, file: Path) -> None:
        self.raw, self.hash, self.size = raw, new_hash(file), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _OVERLAP_BYTES:
            hashed = _hasher().submit(self.hash.update, view)
            try:
                written = self.raw.write(view)
            finally:
                hashed.result()
        else:
            written = self.raw.write(view)
            self.hash.update(view)
        if written != view.nbytes:  # a buffered file writes all or raises: the hash must be of what is on disk
            raise OSError(f"short write ({written} of {view.nbytes} bytes)")
        self.size += written
        return written

    def digest(self) -> dict:
        return {"size": self.size, ALGORITHM: self.hash.hexdigest()}

    def __getattr__(self, name):  # tell, flush, fileno, close...
        return getattr(self.raw, name)


_OVERLAP_BYTES = 1 << 20
_HASHER: list = []
_HASHER_LOCK = threading.Lock()


def _hasher():
    """The one helper thread that hashes a save's large writes while they are written, and a load's files
    while they are deserialised (started on first use)."""
    with _HASHER_LOCK:
        if not _HASHER:
            _HASHER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash"))
        return _HASHER[0]


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording the digest of every data file written through it."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if mode != "wb" or not str(path).endswith(DATA_SUFFIX):
                yield stream
                return
            hashing = _HashingStream(stream, Path(path))
            yield hashing
        with self._lock:
            self.written[Path(path).name] = hashing.digest()


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that hashes each data file's bytes as it writes them: ``written`` holds
    ``{file name: {"size", "sha256"}}`` of this rank's data files once its ``write_data`` is done."""

    def __init__(self, path, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    @property
    def written(self) -> dict[str, dict]:
        return dict(self.fs.written)


class CheckedReader(SafeReader):
    """A SafeReader that checks each file this rank's load plan reads (and ``also``) while reading it:
    a resharded load checks the files it touches, no others, and reads each once (the whole file, to
    hash it; the items the plan needs deserialised from those bytes). Presence and sizes are checked
    before any read, the bytes by the time the file's last byte is read. The check runs inside DCP's
    read step, so a damaged file on one rank reaches every rank (:func:`first_damage`) and all stop
    alike. Without checksums (``verify = false``, an older checkpoint) it is DCP's own reader."""

    def __init__(self, path: Path, checksums: dict[str, dict] | None, also: tuple[str, ...] = ()) -> None:
        super().__init__(str(path))
        self.root, self.checksums, self.also = Path(path), checksums, also

    def read_data(self, plan, planner):
        if self.checksums is None:
            return super().read_data(plan, planner)
        per_file: dict[str, dict] = {}  # file -> storage index -> the plan's reads of that stored item
        for req in plan.items:
            name = self.storage_data[req.storage_index].relative_path
            per_file.setdefault(name, {}).setdefault(req.storage_index, []).append(req)
        for name in sorted(per_file):
            check_listed(self.root, name, self.checksums)  # listed, inside, present, of its size: before any read
        verify_files(self.root, set(self.also) - set(per_file), self.checksums)  # the small RNG file
        for name in sorted(per_file):
            self._read_checked(name, per_file[name], planner)
        done: Future = Future()  # torch's: what DCP waits on
        done.set_result(None)
        return done

    def _read_checked(self, name: str, items: dict, planner) -> None:
        """Read file ``name`` once through a read-only mapping: the helper thread hashes every byte, front to
        back, while this one deserialises the stored ``items`` from the same pages; DamagedCheckpoint when
        the hash (or size) does not match, found before returning."""
        file, want = self.root / name, self.checksums[name]
        hasher, failure = new_hash(self.root / name), None
        with open(file, "rb") as f, _mapped(f) as view:
            hashed = _hasher().submit(_hash_blocks, hasher, view)
            try:
                for index in sorted(items, key=lambda i: self.storage_data[i].offset):
                    info = self.storage_data[index]
                    end = info.offset + info.length
                    try:
                        if end > len(view):
                            raise damaged(self.root, f"{name} has {len(view)} bytes, its index needs {end} (truncated)")
                        self._deliver(items[index], info, view[info.offset:end], planner)
                    except Exception as e:  # noqa: BLE001 -- damage, if the hash says so; else re-raised below
                        failure = e
                        break
            finally:
                hashed.result()
            size = len(view)
        if size != want["size"] or hasher.hexdigest() != want[ALGORITHM]:
            raise _mismatch(self.root, name)
        if failure is not None:
            raise failure

    def _deliver(self, reqs: list, info, data: memoryview, planner) -> None:
        """The plan's reads ``reqs`` of one stored item, from its bytes ``data`` (DCP's own steps)."""
        stream = self.transforms.transform_load_stream(reqs[0], info.transform_descriptors or (), _ViewReader(data))
        if reqs[0].type == LoadItemType.BYTE_IO:
            raw = stream.read(-1)
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(raw))
            return
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
        tensor = torch.load(stream, map_location="cpu", weights_only=True)  # once for all reads of the item
        for req in reqs:
            part = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {part.size()}")
            target.copy_(part)
            planner.commit_tensor(req, target)


@contextlib.contextmanager
def _mapped(f):
    """A read-only memoryview of open file ``f`` (empty for an empty file)."""
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        yield memoryview(b"")
        return
    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapping.madvise(mmap.MADV_SEQUENTIAL)
    view = memoryview(mapping)
    try:
        yield view
    finally:
        view.release()
        try:
            mapping.close()
        except BufferError:  # a slice still referenced (an exception's frame): the GC unmaps it
            pass


class _ViewReader(io.RawIOBase):
    """A seekable binary file over a memoryview: torch.load's reader copies from it straight into the
    tensor's storage (``readinto``), with no intermediate bytes object."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self.view) - self.pos))
        memoryview(buffer).cast("B")[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


def _hash_blocks(hasher, view: memoryview) -> None:
    """Hash ``view`` in blocks (hashlib releases the GIL while it hashes each: the reads go on meanwhile)."""
    for start in range(0, len(view), HASH_BLOCK):
        hasher.update(view[start:start + HASH_BLOCK])
