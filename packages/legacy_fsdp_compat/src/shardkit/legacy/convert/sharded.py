"""SHARDED_STATE_DICT checkpoints: a DCP directory that FSDP1's ranks wrote together.

FSDP1 hands DCP one ShardedTensor (or DTensor) per parameter, cut along dim 0 into one
chunk per rank; DCP stores each chunk where its rank wrote it. Here each tensor is read
whole, one at a time, through DCP's own reader in this one process (``dcp.load`` of that
key alone), so memory holds one tensor. The metadata is read with a restricted unpickler
first, and every data file is checked to hold what the metadata says before anything is read.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from shardkit.legacy.convert.plan import (
    CheckpointError,
    ConversionPlan,
    OutputTensor,
    TensorCheckpoint,
    TensorMeta,
    grouped,
    model_tensors,
)
from shardkit.legacy.convert.safe_load import missing_file, read_dcp_metadata

__all__ = ["ShardedCheckpoint", "first_failure", "sharded_plan", "without_process_group"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedCheckpoint(TensorCheckpoint):
    """An FSDP1 SHARDED_STATE_DICT saved with ``torch.distributed.checkpoint``.

    ``path`` is the checkpoint directory; ``model`` and ``prefix`` as in
    :class:`TensorCheckpoint`.
    """


class _Reader(FileSystemReader):
    """DCP's file reader, with the metadata read once and safely (DCP's would unpickle it)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def files_of(self, name: str) -> list[str]:
        """The data files holding chunks of the tensor ``name``."""
        storage = self._metadata.storage_data or {}
        return sorted({info.relative_path for index, info in storage.items() if index.fqn == name})

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata read at the start, marked with this load's id as DCP's reader does."""
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


@contextmanager
def without_process_group() -> Iterator[None]:
    """Silence DCP's notice that it runs in one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def first_failure(error: CheckpointException) -> BaseException:
    """The exception DCP wrapped (it reports each rank's; here there is one process)."""
    for failure, _trace in error.failures.values():
        return failure
    return error


def _check_files(path: Path, metadata: Metadata) -> None:
    """Every data file exists and is long enough for the chunks the metadata puts in it."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            found = missing_file(file) if file.exists() else "missing"
            raise CheckpointError(f"{file}: {found} (the checkpoint's metadata lists it)")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(f"{file}: truncated: {size} bytes, the metadata needs {end}")


def _meta(item: TensorStorageMetadata) -> TensorMeta:
    return tuple(item.size), item.properties.dtype


def _check_chunks(path: Path, key: str, item: TensorStorageMetadata) -> None:
    """The chunks of a tensor cover it: a rank's part was not left out."""
    held = sum(torch.Size(c.sizes).numel() for c in item.chunks)
    if held != item.size.numel():
        raise CheckpointError(
            f"{path}: {key} has chunks of {held} elements for a tensor of {item.size.numel()}"
        )


def sharded_plan(spec: ShardedCheckpoint) -> ConversionPlan:
    """Read and check the checkpoint's metadata and files; the plan by layer.

    Raises:
        CheckpointError: the metadata is unreadable or refused, a data file is missing or
            truncated, a tensor's chunks do not cover it, or it does not match the model.
    """
    path = Path(spec.path)
    metadata = read_dcp_metadata(path)
    _check_files(path, metadata)
    entries = metadata.state_dict_metadata
    tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    meta = {k: _meta(tensors[k]) if k in tensors else None for k in entries}
    chosen = model_tensors(meta, spec, str(path))
    for name in chosen.values():
        _check_chunks(path, name, tensors[name])
    reader = _Reader(path, metadata)
    return ConversionPlan(
        source=f"SHARDED state dict {path}",
        groups=grouped(
            OutputTensor(key, *_meta(tensors[name]), _loader(reader, name, tensors[name]))
            for key, name in chosen.items()
        ),
    )


def _loader(reader: _Reader, name: str, item: TensorStorageMetadata) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        target = torch.empty(item.size, dtype=item.properties.dtype)
        try:
            with without_process_group():
                dcp_load({name: target}, storage_reader=reader, no_dist=True)
            # torch 2.10's DCP leaves the state dict it loads in reference cycles (recursive
            # closures): a collection of the youngest generation, which holds them, frees each
            # tensor after its write rather than whenever the collector next runs. Cheap.
            gc.collect(0)
        except CheckpointException as err:  # what DCP makes of the reader's errors
            cause = first_failure(err)
            raise CheckpointError(
                f"{reader.path}: cannot read {name} (from {reader.files_of(name)}): "
                f"{type(cause).__name__}: {cause}"
            ) from err
        return target

    return load
