"""Reading DCP checkpoints without running code from them.

DCP's file reader unpickles a checkpoint's ``.metadata`` with ``pickle.load``, and its default
load planner every value that is not a tensor (a step count, a learning rate, an RNG state's
list) with ``torch.load(weights_only=False)``: whoever can write into a checkpoint directory
could run code in every process that loads it. ``CheckpointManager`` reads through these
instead:

- ``read_dcp_metadata``: the ``.metadata`` through an unpickler that admits DCP's metadata
  classes, torch sizes, dtypes and paths and nothing else, then checked field by field (every
  data file inside the checkpoint, offsets and lengths whole numbers, chunks of the tensor's
  rank);
- ``SafeFileSystemReader``: DCP's file reader, with that metadata;
- ``SafeLoadPlanner``: DCP's default load planner, with each value that is not a tensor read by
  ``torch.load(weights_only=True)``: plain values, containers, tensors, and the classes a user
  allows with ``torch.serialization.add_safe_globals``. Tensors DCP already reads that way.
- ``unsafe_values``: those values checked the same way before anything is loaded, so that a
  checkpoint holding a refused one leaves the state as it was;
- ``LoadableSavePlanner``: DCP's default save planner, refusing at save a value that the safe
  reader would refuse at load (a checkpoint found unloadable at a restart is found too late).

See [Note: agreed loads] and docs/checkpoints.md.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

# The default planner's own helper for a nested key (the same in every release from 2.10).
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from shardkit.core.errors import StateDictFileError

__all__ = [
    "LoadableSavePlanner",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_dcp_metadata",
    "unsafe_values",
    "value_keys",
]

# Every global a .metadata pickle of DCP names. ``_StorageInfo`` (where each item's bytes lie)
# is admitted by its name only: nothing private of torch's is imported.
_DCP_CLASSES = {
    (dcp_metadata.__name__, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("collections", "OrderedDict"),
    *((pathlib.__name__, kind) for kind in ("PosixPath", "WindowsPath", "PurePosixPath")),
}


# torch's weights_only refusal names the global it would not load, in a longer explanation.
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


class _RefusedGlobal(pickle.UnpicklingError):
    """A global outside the allowlist (other unpickling errors mean damaged bytes)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own dataclasses, torch sizes and dtypes, paths."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedGlobal(f"refused global {module}.{name}")


def read_dcp_metadata(checkpoint: str | Path) -> dcp_metadata.Metadata:
    """The ``.metadata`` of a DCP checkpoint directory, read without running pickled code.

    Only DCP's metadata classes, torch sizes and dtypes, and paths are admitted; then every
    field is checked to hold what DCP writes there, so that damaged metadata is reported here
    rather than as a raw error where a field is used.

    Raises:
        StateDictFileError: naming the file, when it is missing, truncated, damaged, or names
            any other global.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        found = "no such directory" if not checkpoint.exists() else "is not a directory"
        raise StateDictFileError(f"{checkpoint}: {found} (a DCP checkpoint is a directory)")
    path = checkpoint / ".metadata"
    if not path.is_file():
        found = "no such file" if not path.exists() else "is not a regular file"
        raise StateDictFileError(f"{checkpoint}: not a DCP checkpoint (.metadata {found})")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _RefusedGlobal as err:
        raise StateDictFileError(f"{path}: refused: {err}") from err
    except Exception as err:  # UnpicklingError or EOFError when truncated, and the like
        detail = f"truncated or corrupt: {type(err).__name__}: {err}"
        raise StateDictFileError(f"{path}: {detail}") from err
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise StateDictFileError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    problem = _metadata_problem(metadata)
    if problem:
        raise StateDictFileError(f"{path}: damaged DCP metadata: {problem}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the metadata read by ``read_dcp_metadata`` (once)."""

    def __init__(self, path: str | Path, metadata: dcp_metadata.Metadata | None = None) -> None:
        super().__init__(path)
        self._safe_metadata = metadata if metadata is not None else read_dcp_metadata(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The checked metadata, marked with this load's id as DCP's own reader marks it."""
        metadata = self._safe_metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; values that are not tensors are read with weights_only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Put one value where the default planner puts it, read with ``weights_only=True``."""
        loaded = _weights_only(read_item.dest_index.fqn, value)
        if self.flatten_state_dict:  # the default planner's own placing, nested keys and all
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class LoadableSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, refusing a value that ``SafeLoadPlanner`` could not read back.

    Each value that is not a tensor is pickled and read back with ``weights_only=True`` when
    the save is planned: a class the safe reader refuses fails the save on every rank (DCP
    reports a planning failure everywhere), naming the key and the remedy, instead of writing
    a checkpoint that no load would take.
    """

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: dcp_metadata.StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Set up DCP's plan, then read back every value that is not a tensor."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        for key, value in self.state_dict.items():
            if not isinstance(value, torch.Tensor):
                pickled = io.BytesIO()
                torch.save(value, pickled)
                pickled.seek(0)
                _weights_only(key, pickled)


class _Checker(SafeLoadPlanner):
    """Reads values as ``SafeLoadPlanner`` does, keeping why any was refused."""

    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            _weights_only(read_item.dest_index.fqn, value)
        except StateDictFileError as error:
            self.problems.append(str(error))


def unsafe_values(
    checkpoint: str | Path, metadata: dcp_metadata.Metadata, keys: list[str]
) -> list[str]:
    """Why each of the non-tensor values ``keys`` of the checkpoint cannot be read ([] if all can).

    Reads each with ``weights_only=True``, through DCP's file reader (its transforms
    included), writing nothing.
    """
    if not keys:
        return []
    items = [
        ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=dcp_metadata.MetadataIndex(key),
            dest_offsets=torch.Size([0]),
            storage_index=dcp_metadata.MetadataIndex(key),
            storage_offsets=torch.Size([0]),
            lengths=torch.Size([0]),
        )
        for key in keys
    ]
    reader = SafeFileSystemReader(checkpoint, metadata)
    reader.set_up_storage_reader(metadata, False)
    checker = _Checker()
    reader.read_data(LoadPlan(items), checker).wait()
    return checker.problems


def value_keys(metadata: dcp_metadata.Metadata) -> list[str]:
    """The checkpoint's values that are not tensors, by key, sorted."""
    entries = metadata.state_dict_metadata
    return sorted(k for k, v in entries.items() if isinstance(v, dcp_metadata.BytesStorageMetadata))


def _weights_only(key: str, value: io.BytesIO) -> object:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        named = _UNSUPPORTED_GLOBAL.search(str(error))
        what = f"global {named.group(1)}" if named else "a pickled object"
        raise StateDictFileError(
            f"value {key!r} is a pickled object that weights_only refuses ({what}): allow its "
            "class with torch.serialization.add_safe_globals if the checkpoint is trusted"
        ) from None
    except Exception as error:
        raise StateDictFileError(
            f"value {key!r} cannot be read: {type(error).__name__}: {error}"
        ) from None


def _metadata_problem(metadata: dcp_metadata.Metadata) -> str:
    """What in the metadata is not of the kind DCP writes ('' when all is)."""
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        return f"state_dict_metadata is a {type(entries).__name__}, not a dict by key"
    for key, entry in entries.items():
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            problem = _tensor_problem(entry)
            if problem:
                return f"{key}: {problem}"
        elif not isinstance(entry, dcp_metadata.BytesStorageMetadata):
            return f"{key} is described by a {type(entry).__name__}"
    if storage is None:
        return ""
    if not isinstance(storage, dict):
        return f"storage_data is a {type(storage).__name__}, not a dict"
    for index, info in storage.items():
        where = getattr(index, "fqn", index)
        fields = (getattr(info, name, None) for name in ("relative_path", "offset", "length"))
        relative_path, offset, length = fields
        if not isinstance(relative_path, str) or not _inside(relative_path):
            return f"{where}: its data file is {relative_path!r}"
        if not _natural(offset) or not _natural(length):
            return f"{where}: its bytes are at offset {offset!r}, length {length!r}"
    return ""


def _tensor_problem(entry: dcp_metadata.TensorStorageMetadata) -> str:
    properties = getattr(entry, "properties", None)
    if not isinstance(getattr(properties, "dtype", None), torch.dtype):
        return "no dtype"
    if not isinstance(entry.size, torch.Size) or not all(_natural(n) for n in entry.size):
        return f"size {entry.size!r}"
    for chunk in entry.chunks if isinstance(entry.chunks, list) else [None]:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not isinstance(offsets, torch.Size) or not isinstance(sizes, torch.Size):
            return f"a chunk of {chunk!r}"
        if len(offsets) != len(entry.size) or len(sizes) != len(entry.size):
            return f"a chunk at {list(offsets)} of {list(sizes)} in a tensor of {list(entry.size)}"
    return ""


def _inside(relative_path: str) -> bool:
    """A path that stays inside the checkpoint directory (not absolute, no ``..``)."""
    return not Path(relative_path).is_absolute() and ".." not in Path(relative_path).parts


def _natural(value: object) -> bool:
    """A non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
