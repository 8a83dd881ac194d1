"""What the locally planned save's tests share: a checkpoint's ``.metadata`` read and
compared, saved tensors compared bit for bit, and the collectives a save makes before its
first file write counted (``tests/core/checkpoint/``, ``tests/legacy/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["CollectivesBeforeWrite", "assert_same", "metadata_content", "read_metadata"]


class CollectivesBeforeWrite:
    """Counts the torch.distributed calls made before the first file write of a save."""

    NAMES = (
        "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
        "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv",
        "isend", "recv", "reduce_scatter", "reduce_scatter_tensor", "scatter",
        "scatter_object_list", "send",
    )  # fmt: skip

    def __enter__(self) -> CollectivesBeforeWrite:
        import torch.distributed as dist
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        self.calls, self.before_write = 0, -1
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        self.write = FileSystemWriter.write_data

        def counted(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return original(*args, **kwargs)

            return call

        def write_data(writer: Any, *args: Any, **kwargs: Any) -> Any:
            if self.before_write < 0:
                self.before_write = self.calls
            return self.write(writer, *args, **kwargs)

        for name, original in self.saved.items():
            setattr(dist, name, counted(original))
        FileSystemWriter.write_data = write_data  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        for name, original in self.saved.items():
            setattr(dist, name, original)
        FileSystemWriter.write_data = self.write  # type: ignore[method-assign]


def read_metadata(path: Path) -> Metadata:
    """A checkpoint directory's ``.metadata``, as DCP reads it."""
    return FileSystemReader(str(path)).read_metadata()


def metadata_content(metadata: Metadata) -> dict[str, Any]:
    """What two saves of one state must agree on: every tensor's properties, size and
    chunks, the flattening's mappings, and which (key, offset) entries have storage."""
    out: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            out[fqn] = (entry.properties, tuple(entry.size), chunks)
        else:
            out[fqn] = type(entry).__name__
    stored = sorted((i.fqn, tuple(i.offset or ())) for i in metadata.storage_data)
    return {"tensors": out, "mappings": metadata.planner_data, "stored": stored}


def assert_same(ours: Any, theirs: Any, where: str) -> None:
    """Equal, tensors bit for bit, through nested dicts and lists."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list | tuple):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where
