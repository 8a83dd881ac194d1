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
- DCP's ``.metadata`` is a plain pickle, which torch reads with ``pickle.load``; the core's
  ``read_dcp_metadata`` reads it with a restricted unpickler that admits DCP's metadata
  classes, torch dtypes and sizes, and nothing else.

torch's private ShardedTensor classes themselves are named in ``torch_compat.py`` only.
See [Note: FSDP1 checkpoints] (docs/notes/010-fsdp1-checkpoints.md).
"""

from __future__ import annotations

import logging
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from shardkit.core import StateDictFileError
from shardkit.core import load_torch_file as core_load_torch_file
from shardkit.core import read_dcp_metadata as core_read_dcp_metadata
from shardkit.legacy.convert.plan import CheckpointError
from shardkit.legacy.torch_compat import (
    SHARDED_TENSOR_CLASS,
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


def read_dcp_metadata(checkpoint: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    """The ``.metadata`` of a DCP checkpoint directory, read by the core's restricted reader.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, damaged, or names
            any global but DCP's metadata classes, torch sizes, dtypes and paths.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        found = missing_file(checkpoint, "directory") or "is a file, not a directory"
        raise CheckpointError(f"{checkpoint}: {found} (a DCP checkpoint is a directory)")
    not_a_file = missing_file(checkpoint / ".metadata")
    if not_a_file:
        raise CheckpointError(f"{checkpoint}: not a DCP checkpoint (.metadata {not_a_file})")
    try:
        return core_read_dcp_metadata(checkpoint)
    except StateDictFileError as err:
        raise CheckpointError(str(err)) from err
