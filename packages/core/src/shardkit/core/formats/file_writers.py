"""Single-file state dicts written one tensor at a time: safetensors and torch.save's format.

Both writers take the list of entries (names, shapes, dtypes) up front and then the tensors
in that order, so a full state dict streams to disk without ever being whole in memory.
Neither library writes that way (both want every tensor at once), hence writers of our own;
reading goes through the libraries (``file_readers.py``). See [Note: file readers].
"""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

__all__ = [
    "Entry",
    "FileWriter",
    "SafetensorsWriter",
    "TorchSaveWriter",
    "SAFETENSORS_DTYPES",
    "format_of",
    "open_writer",
]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}
"""The safetensors name of every dtype both formats know."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a state dict file: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * self.dtype.itemsize


class FileWriter(Protocol):
    """Writes the entries given at open, in that order, then ``close()``."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next entry's data (a CPU tensor of the announced shape and dtype)."""

    def write_chunks(self, name: str, chunks: list[torch.Tensor]) -> None:
        """Write the next entry's data given as consecutive pieces of its flat bytes."""

    def close(self) -> None:
        """Finish the file."""


def format_of(path: str | os.PathLike[str]) -> str:
    """'safetensors' for a ``.safetensors`` file, else 'torch' (torch.save's format)."""
    return "safetensors" if str(path).endswith(".safetensors") else "torch"


def open_writer(
    path: Path, entries: list[Entry], file_format: str, key_order: list[str] | None = None
) -> FileWriter:
    """A writer for ``entries`` (in write order) in ``file_format``.

    ``key_order`` is the order the keys are presented in when the file is read back (the
    model's state dict order), where the format has one.
    """
    if file_format == "safetensors":
        return SafetensorsWriter(path, entries)
    if file_format == "torch":
        return TorchSaveWriter(path, entries, key_order)
    raise ValueError(f"unknown state dict file format {file_format!r} (safetensors or torch)")


def _as_buffer(flat_bytes: torch.Tensor) -> memoryview:
    """A writable view of a contiguous uint8 CPU tensor's memory (no copy)."""
    view: memoryview = memoryview(flat_bytes.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
    return view


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return _as_buffer(tensor.detach().contiguous().view(-1).view(torch.uint8))


class SafetensorsWriter:
    """safetensors: an 8-byte header length, a JSON header of offsets, then raw data."""

    def __init__(self, path: Path, entries: list[Entry]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for entry in entries:
            if entry.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"{entry.name}: dtype {entry.dtype} has no safetensors name")
            end = offset + entry.nbytes
            header[entry.name] = {
                "dtype": SAFETENSORS_DTYPES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115  (closed in close())
        try:
            self._file.write(struct.pack("<Q", len(raw)) + raw)
        except BaseException:
            self._file.close()  # no writer to close it: the caller removes the file
            raise
        self._pending: Iterator[Entry] = iter(entries)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor's bytes."""
        self.write_chunks(name, [tensor])

    def write_chunks(self, name: str, chunks: list[torch.Tensor]) -> None:
        """Append the next tensor's bytes, piece by piece (no copy to join them)."""
        entry = next(self._pending)
        assert entry.name == name, f"expected {entry.name} next, got {name}"
        assert sum(c.numel() * c.element_size() for c in chunks) == entry.nbytes, name
        for chunk in chunks:
            self._file.write(_tensor_bytes(chunk))

    def close(self) -> None:
        """Flush to disk, and close the file even when that fails (a full disk)."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


class _StorageRef:
    """Stands for a storage already written as ``data/<key>`` (pickled as a persistent id)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Stands for a tensor; pickles as torch's tensor rebuild call on a ``_StorageRef``."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self) -> tuple[Any, ...]:
        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        args: tuple[Any, ...] = (
            self.storage,
            0,
            self.shape,
            stride,
            False,
            collections.OrderedDict(),
        )
        return (torch._utils._rebuild_tensor_v2, args)


class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, _storage_type_name(obj.dtype))
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def _storage_type_name(dtype: torch.dtype) -> str:
    name: str = torch.storage._dtype_to_storage_type_map()[dtype]
    return name


class TorchSaveWriter:
    """torch.save's zip format, storages first and the pickle last, so it can stream.

    ``torch.load`` finds records by name, so their order in the archive does not matter.
    """

    def __init__(self, path: Path, entries: list[Entry], key_order: list[str] | None) -> None:
        self._writer = torch._C.PyTorchFileWriter(str(path))
        self._order = key_order or [e.name for e in entries]
        self._pending: Iterator[Entry] = iter(entries)
        self._refs: dict[str, _TensorRef] = {}

    def write_chunks(self, name: str, chunks: list[torch.Tensor]) -> None:
        """A record is written in one piece: join the chunks first."""
        self.write(name, torch.cat([c.reshape(-1) for c in chunks]))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor's storage as its own record."""
        entry = next(self._pending)
        assert entry.name == name, f"expected {entry.name} next, got {name}"
        data = tensor.detach().contiguous()
        if data.storage_offset() != 0:
            data = data.clone()  # the record is written from the start of the storage
        key = str(len(self._refs))
        storage = data.untyped_storage()
        # torch's stub says Storage; the writer takes an UntypedStorage (as torch.save passes).
        self._writer.write_record(f"data/{key}", storage, entry.nbytes)  # type: ignore[arg-type]
        self._refs[name] = _TensorRef(_StorageRef(key, entry.dtype, data.numel()), entry.shape)

    def close(self) -> None:
        """Write the pickle of the state dict (references to the records) and finish."""
        buffer = _PickleBuffer()
        ordered = {k: self._refs[k] for k in self._order if k in self._refs}
        _RefPickler(buffer, protocol=2).dump(ordered)
        data = bytes(buffer.data)
        self._writer.write_record("data.pkl", data, len(data))
        for name, value in (
            (".format_version", b"1"),
            (".storage_alignment", b"64"),
            ("byteorder", sys.byteorder.encode()),
        ):
            self._writer.write_record(name, value, len(value))
        self._writer.write_end_of_file()


class _PickleBuffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        return len(chunk)
