"""The load side of checkpoint integrity: DCP's reader, checking each file it reads against ``checksums.json``.

Each data file is read once, front to back, through a read-only mapping: the helper thread
(:func:`.integrity.hasher_thread`) hashes every byte while the items the load plan needs are
deserialised from the same pages, so a mismatch is found before the load returns, with no second read.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
from pathlib import Path

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ..errors import damaged
from . import integrity
from .integrity import ALGORITHM, HASH_BLOCK, check_listed, mismatch, hasher_thread, verify_files
from .safe_metadata import SafeReader


class CheckedReader(SafeReader):
    """A SafeReader that checks each file this rank's load plan reads (and ``also``) while reading it:
    a resharded load checks the files it touches, no others, and reads each once (the whole file, to
    hash it; the items the plan needs deserialised from those bytes). Presence and sizes are checked
    before any read, the bytes by the time the file's last byte is read. The check runs inside DCP's
    read step, so a damaged file on one rank reaches every rank (:func:`.integrity.first_damage`) and all stop
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
        hasher, failure = integrity.new_hash(self.root / name), None  # the module's: one place hooks every hash
        with open(file, "rb") as f, _mapped(f) as view:
            hashed = hasher_thread().submit(_hash_blocks, hasher, view)
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
            raise mismatch(self.root, name)
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
