"""Reading state dict files: the whole file is checked at open, then tensors are read one by one.

- safetensors (``.safetensors``): the safetensors library's ``safe_open``. It validates the
  whole header before anything is read (its size against a limit and the file, JSON, known
  dtypes, offsets contiguous, inside the file and equal to shape x dtype) and reads each
  tensor completely from a memory map. When it refuses a file, the error says where, from
  :func:`~shardkit.core.formats.safetensors_explain.explain_safetensors`.
- torch.save's format (anything else): ``torch.load(weights_only=True)``, so nothing but
  tensors and plain containers is ever unpickled; memory-mapped for the zip format, read whole
  for the legacy (pre-1.6, non-zip) one, which cannot be mapped.

Every problem with the file's content raises :class:`StateDictFileError` naming the file and
what is wrong where. See [Note: file readers].
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Protocol, cast

import torch
from safetensors import SafetensorError, safe_open

from shardkit.core.errors import StateDictFileError, first_sentence
from shardkit.core.formats.file_writers import SAFETENSORS_DTYPES, Entry, format_of
from shardkit.core.formats.safetensors_explain import explain_safetensors
from shardkit.core.formats.torch_legacy import BoundedFile, check_storage_claims
from shardkit.core.formats.torch_zip import ZIP_MAGIC, check_zip

__all__ = [
    "SafetensorsReader",
    "StateDictReader",
    "TorchFileReader",
    "load_torch_file",
    "open_reader",
]

logger = logging.getLogger(__name__)

_DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class StateDictReader(Protocol):
    """An open state dict file whose every entry was checked when it was opened."""

    path: Path
    entries: list[Entry]
    """Every tensor in the file, in file order."""

    def read(self, entry: Entry) -> torch.Tensor:
        """One entry's tensor, complete (a CPU tensor of the entry's shape and dtype)."""

    def close(self) -> None:
        """Release the file."""


def open_reader(path: str | os.PathLike[str]) -> StateDictReader:
    """Open a state dict file, checking all of it before any tensor is read.

    Raises:
        StateDictFileError: the file is malformed, truncated, or holds more than tensors.
        OSError: the file cannot be opened (missing, a directory, no permission).
    """
    path = Path(path)
    if not path.is_file():
        path.open("rb").close()  # the OSError that says why, naming the file
    if format_of(path) == "safetensors":
        return SafetensorsReader(path)
    return TorchFileReader(path)


class SafetensorsReader:
    """A safetensors file, through the safetensors library."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path = Path(path)
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
            names: list[str] = self._file.offset_keys()
            slices = [(name, self._file.get_slice(name)) for name in names]
        except SafetensorError as error:
            where = explain_safetensors(path) or str(error)
            raise StateDictFileError(f"{path} is not a valid safetensors file: {where}") from None
        self.entries = [
            Entry(name, tuple(piece.get_shape()), self._dtype(name, piece.get_dtype()))
            for name, piece in slices
        ]

    def _dtype(self, name: str, dtype_name: str) -> torch.dtype:
        if dtype_name not in _DTYPES_BY_NAME:
            known = ", ".join(_DTYPES_BY_NAME)
            raise StateDictFileError(
                f"{self.path}: tensor {name!r} has dtype {dtype_name}, which torch cannot load "
                f"here (known: {known})"
            )
        return _DTYPES_BY_NAME[dtype_name]

    def read(self, entry: Entry) -> torch.Tensor:
        """One tensor, read whole by the library."""
        try:
            tensor: torch.Tensor = self._file.get_tensor(entry.name)
        except SafetensorError as error:
            message = f"{self.path}: reading {entry.name!r} failed: {error}"
            raise StateDictFileError(message) from None
        return tensor

    def close(self) -> None:
        """Unmap the file."""
        self._file.__exit__(None, None, None)


class TorchFileReader:
    """A torch.save file, read with ``weights_only=True`` (never unpickles arbitrary objects)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path = Path(path)
        self._tensors = _load_weights_only(path)
        self.entries = [Entry(k, tuple(t.shape), t.dtype) for k, t in self._tensors.items()]

    def read(self, entry: Entry) -> torch.Tensor:
        """One tensor (from the memory map, for the zip format)."""
        return self._tensors[entry.name].contiguous()

    def close(self) -> None:
        """Drop the tensors (and with them the memory map)."""
        self._tensors = {}


def _load_weights_only(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a torch.save file, by key.

    Raises:
        StateDictFileError: the file is not a readable torch.save file of a dict, or holds
            objects that only arbitrary unpickling could build.
    """
    loaded = load_torch_file(path)
    if not isinstance(loaded, dict):
        raise StateDictFileError(
            f"{path} holds a {type(loaded).__name__}, not a state dict (a dict of tensors)"
        )
    return {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}


def load_torch_file(path: str | os.PathLike[str], *, safe_globals: Sequence[Any] = ()) -> Any:
    """What an untrusted torch.save file holds, read with ``weights_only=True`` and checked.

    Beyond what torch.load checks: a zip file's records are each checked against the archive
    and the pickle's declarations (each storage's record present, of the declared size, stored
    or DEFLATE-compressed) before it is memory-mapped; mapped, torch takes them on trust. A
    file with compressed records is read unmapped, decompressed by torch's zip reader. A legacy
    (pre-1.6) file's declared storages are added up against its size before torch allocates
    them, its reads bounded by the file (a flipped bit in a length would otherwise allocate
    gigabytes). Nothing in the file is ever run.

    Args:
        path: the file.
        safe_globals: classes or functions beyond weights_only's own that the file may name,
            as ``torch.serialization.safe_globals`` takes them (FSDP1's ShardedTensor records,
            for instance).

    Raises:
        StateDictFileError: naming the file, when it is empty, truncated, damaged, or holds
            objects that weights_only does not load.
        OSError: the file cannot be opened.
    """
    source = Path(path)
    with open(source, "rb") as f:
        # The legacy format cannot be memory-mapped. The magic number, unlike
        # zipfile.is_zipfile, also tells a truncated zip file (no central directory) apart.
        is_zip = f.read(4) == ZIP_MAGIC
    size = source.stat().st_size
    if size == 0:
        raise StateDictFileError(f"{source} is empty (0 bytes), not a torch.save file")
    mapped = is_zip and _mappable(source, size)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return _torch_load(source, size, is_zip=is_zip, mapped=mapped)
    except StateDictFileError:
        raise
    except pickle.UnpicklingError as error:
        raise StateDictFileError(
            f"{source} holds something other than tensors and plain containers, or is not a "
            f"torch.save file: torch.load with weights_only=True refused it "
            f"({_reason(error)}), and shardkit never unpickles arbitrary objects"
        ) from None
    except Exception as error:  # torch reports a broken file with many types (EOFError, ...)
        kind = "zip" if is_zip else "legacy (non-zip)"
        raise StateDictFileError(
            f"{source} is not a readable torch.save file ({kind} format, {size} bytes): "
            f"{type(error).__name__}: {first_sentence(str(error))}"
        ) from None


def _mappable(path: Path, size: int) -> bool:
    """Check a zip file's records; whether all its storages can be read from a memory map."""
    check = check_zip(path, size)
    if not check.mappable:
        # Mapped, torch would load the compressed bytes themselves.
        logger.info(
            "%s: %d compressed record(s) (%s ...): read whole and decompressed, not mapped",
            path,
            len(check.compressed),
            check.compressed[0],
        )
    return check.mappable


def _torch_load(path: Path, size: int, *, is_zip: bool, mapped: bool) -> Any:
    """torch.load with weights_only; a legacy file's claims checked first, its reads bounded."""
    if is_zip:
        # Unmapped, torch's zip reader reads each record whole (decompressing it).
        return torch.load(path, map_location="cpu", mmap=mapped, weights_only=True)
    with open(path, "rb") as f:
        check_storage_claims(path, BoundedFile(f, size), size)
        f.seek(0)
        bounded = cast(IO[bytes], BoundedFile(f, size))  # a binary file, as torch.load reads
        return torch.load(bounded, map_location="cpu", weights_only=True)


def _reason(error: pickle.UnpicklingError) -> str:
    """The sentence of torch's weights_only refusal that says what it refused."""
    # The message is advice around one line, "WeightsUnpickler error: <what was refused>".
    _, found, rest = str(error).partition("WeightsUnpickler error:")
    return first_sentence(" ".join((rest if found else str(error)).split())) or "no reason given"
