"""Reading DCP's ``.metadata`` without running code from the file.

DCP stores a checkpoint's index as a pickle; ``pickle.load`` on a crafted file can call any
importable function. :class:`SafeReader` reads it with an unpickler that resolves only DCP's own
metadata classes, torch dtypes/``Size``/layouts and paths: anything else is a one-line error.
(The tensor data files are raw bytes; DCP reads its few non-tensor items with ``weights_only``.)
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

from ..errors import UsageError, damaged

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                              "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not a checkpoint metadata class)")


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata comes from the restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError, IndexError,
                KeyError, ImportError) as e:
            raise UsageError(f"checkpoint {self.path} is corrupt or unsafe: cannot read {path.name} ({e})") from None
        if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
            raise UsageError(f"checkpoint {self.path}: {path.name} is not DCP metadata")
        check_data_files(self.path, metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_data_files(path, metadata) -> None:
    """Every byte range the index names must be in a file inside ``path``: a missing, truncated or
    escaping shard is one line here, not a failure of DCP's read on every rank."""
    need: dict[str, int] = {}
    storage = getattr(metadata, "storage_data", None) or {}
    for info in storage.values() if isinstance(storage, dict) else [None]:
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not (isinstance(offset, int) and isinstance(length, int)):
            raise UsageError(f"checkpoint {path}: .metadata holds no valid storage index")
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UsageError(f"checkpoint {path}: .metadata names the data file {name!r}, which is not a file inside it")
        need[name] = max(need.get(name, 0), offset + length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"has {have} bytes, its index needs {size} (truncated)"
            raise damaged(path, f"{name} {what}")


def read_metadata(path) -> object:
    """The DCP metadata of checkpoint directory ``path``, read safely."""
    return SafeReader(str(path)).read_metadata()
