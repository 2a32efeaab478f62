"""The save side of checkpoint integrity: DCP's writer, hashing each data file's bytes as it writes them.

No second pass over the files: a large write's bytes are hashed in :func:`.integrity.hasher_thread`
while the file takes them. Rank 0 writes the digests into ``checksums.json`` (:mod:`.integrity`).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from . import integrity
from .integrity import ALGORITHM, DATA_SUFFIX, hasher_thread

_OVERLAP_BYTES = 1 << 20  # a write this large is hashed in the helper thread while it is written


class _HashingStream:
    """A binary file being written whose bytes are hashed on their way to it (a large write's bytes
    hashed in the helper thread while the file takes them: both release the GIL)."""

    def __init__(self, raw, file: Path) -> None:
        self.raw, self.hash, self.size = raw, integrity.new_hash(file), 0  # the module's: one place hooks every hash

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _OVERLAP_BYTES:
            hashed = hasher_thread().submit(self.hash.update, view)
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
