"""Reading FSDP1's files without unpickling anything but tensors and plain data.

- torch.save files go through the core's ``load_torch_file`` (``torch.load(weights_only=True)``,
  memory-mapped once every zip record is checked; a legacy file's storage sizes checked
  against the file before torch allocates them). LOCAL state
  dicts hold ShardedTensors, which weights_only refuses: they are allowed through
  ``torch.serialization.safe_globals`` as exactly the types their pickles name, with two
  stand-ins. A real ShardedTensor cannot be rebuilt here (its ``__setstate__`` wants the
  process group it was saved from), so its name maps to :class:`ShardedTensorRecord`, which
  only keeps the pickled state; and the one ``getattr`` such a pickle makes (to reach
  ``ShardedTensor.ProcessGroupState``) maps to a function that allows exactly that lookup.
- DCP's ``.metadata`` is a plain pickle, which torch reads with ``pickle.load``; here a
  restricted unpickler admits DCP's metadata classes, torch dtypes and sizes, and nothing else.

torch's private ShardedTensor classes themselves are named in ``torch_compat.py`` only.
See [Note: FSDP1 checkpoints] (docs/notes/010-fsdp1-checkpoints.md).
"""

from __future__ import annotations

import logging
import os
import pathlib
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from shardkit.core import StateDictFileError
from shardkit.core import load_torch_file as core_load_torch_file
from shardkit.legacy.convert.plan import CheckpointError
from shardkit.legacy.torch_compat import (
    SHARDED_TENSOR_CLASS,
    dcp_storage_info_module,
    process_group_state_type,
    sharded_tensor_pickle_types,
)

__all__ = [
    "LocalShard",
    "ShardedTensorRecord",
    "load_torch_file",
    "missing_file",
    "read_dcp_metadata",
]

logger = logging.getLogger(__name__)

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
_LEGACY_MAGIC = b"\x80\x02\x8a\n"  # before it: a protocol-2 pickle of a 10-byte magic number
_SHARDED_TENSOR = SHARDED_TENSOR_CLASS


class ShardedTensorRecord(torch.Tensor):
    """What a pickled ShardedTensor loads as here: its pickled state, and no process group."""

    pickled_state: tuple[Any, ...]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares a plain function
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        # torch requires it of a wrapper subclass; a record is never computed with.
        raise TypeError(f"{func}: a ShardedTensor read for conversion holds data, not a tensor")

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.pickled_state = state


def _nested_class(owner: object, name: str) -> type:
    """The ``getattr`` a ShardedTensor pickle makes, and no other."""
    if owner is ShardedTensorRecord and name == "ProcessGroupState":
        return process_group_state_type()
    raise pickle.UnpicklingError(f"refused getattr({owner!r}, {name!r})")


_LOCAL_STATE_DICT_TYPES: list[Any] = [
    *sharded_tensor_pickle_types(),
    (ShardedTensorRecord, _SHARDED_TENSOR),
    (process_group_state_type(), f"{_SHARDED_TENSOR}.ProcessGroupState"),
    (_nested_class, "builtins.getattr"),
]


@dataclass(frozen=True, slots=True)
class LocalShard:
    """One rank's piece of a 1-D ShardedTensor, as FSDP1's LOCAL_STATE_DICT stores it."""

    data: torch.Tensor | None
    """The local shard (1-D); None when the rank holds none of it."""
    offset: int
    """Where it starts in the whole tensor."""
    numel: int
    """Elements of the whole tensor."""
    rank: int
    """The rank that saved it, in FSDP1's process group."""
    world_size: int
    """The size of that process group when it was saved."""

    @classmethod
    def of(cls, record: ShardedTensorRecord, key: str, path: Path) -> LocalShard:
        """Read a record, checking it is the 1-D ShardedTensor with one local shard FSDP1 makes.

        Raises:
            CheckpointError: naming the file and key, when it is not.
        """
        try:
            local_shards, metadata, group, _spec, _rrefs = record.pickled_state
            (numel,) = tuple(metadata.size)
            rank, world_size = int(group.local_rank), int(group.local_world_size)
        except (AttributeError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"{path}: {key} is not a 1-D ShardedTensor as FSDP1 saves it ({err})"
            ) from err
        if not local_shards:
            return cls(data=None, offset=0, numel=numel, rank=rank, world_size=world_size)
        if len(local_shards) != 1 or local_shards[0].tensor.dim() != 1:
            raise CheckpointError(
                f"{path}: {key} has {len(local_shards)} local shard(s); FSDP1 saves one, 1-D"
            )
        (shard,) = local_shards
        (offset,) = shard.metadata.shard_offsets
        return cls(shard.tensor, offset, numel, rank, world_size)


def load_torch_file(path: str | os.PathLike[str]) -> Any:
    """``torch.load(path, weights_only=True)`` through the core's checked reader.

    ShardedTensors load as records. The core checks a zip file's records before mapping it
    (reading compressed ones unmapped) and bounds a legacy file's declared storages by its
    size before torch allocates them.

    Raises:
        CheckpointError: naming the file, when it is missing (or a directory), truncated or
            corrupt, or holds pickled objects that weights_only refuses.
    """
    path = Path(path)
    not_a_file = missing_file(path)
    if not_a_file:
        raise CheckpointError(f"{path}: {not_a_file}")
    with open(path, "rb") as f:
        head = f.read(4)
    mapped = zipfile.is_zipfile(path)
    if head == _ZIP_MAGIC and not mapped:
        raise CheckpointError(
            f"{path}: truncated or corrupt (a torch.save zip file without its directory)"
        )
    if not mapped and head != _LEGACY_MAGIC:
        raise CheckpointError(f"{path}: not a torch.save file (neither zip nor legacy format)")
    if not mapped:
        logger.warning("%s: torch's legacy format (torch < 1.6): read whole, not mapped", path)
    try:
        return core_load_torch_file(path, safe_globals=_LOCAL_STATE_DICT_TYPES)
    except StateDictFileError as err:
        # The core's message names the file and says what is wrong, refusals included.
        raise CheckpointError(str(err)) from err


def missing_file(path: Path, what: str = "file") -> str:
    """Why ``path`` is not a regular file (naming what it is instead); '' when it is one."""
    if path.is_file():
        return ""
    if path.is_dir():
        return f"is a directory, not a {what}"
    if path.exists():
        return f"is not a regular file (a {what} was expected)"
    return f"no such {what}"


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
    (dcp_storage_info_module(), "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("collections", "OrderedDict"),
    *((pathlib.__name__, kind) for kind in ("PosixPath", "WindowsPath", "PurePosixPath")),
}


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


def read_dcp_metadata(checkpoint: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    """The ``.metadata`` of a DCP checkpoint directory, read with the restricted unpickler.

    Its structure is checked too (what each field holds), so that damaged metadata is
    reported here rather than as a raw error where a field is used.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, damaged, or names
            any other global.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        found = missing_file(checkpoint, "directory") or "is a file, not a directory"
        raise CheckpointError(f"{checkpoint}: {found} (a DCP checkpoint is a directory)")
    path = checkpoint / ".metadata"
    not_a_file = missing_file(path)
    if not_a_file:
        raise CheckpointError(f"{checkpoint}: not a DCP checkpoint (.metadata {not_a_file})")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _RefusedGlobal as err:
        raise CheckpointError(f"{path}: refused: {err}") from err
    except Exception as err:  # UnpicklingError or EOFError when truncated, and the like
        raise CheckpointError(f"{path}: truncated or corrupt: {type(err).__name__}: {err}") from err
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    problem = _metadata_problem(metadata)
    if problem:
        raise CheckpointError(f"{path}: damaged DCP metadata: {problem}")
    return metadata


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
