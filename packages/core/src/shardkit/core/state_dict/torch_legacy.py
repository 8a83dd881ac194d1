"""torch.save's legacy (non-zip) format: what a file claims, checked before torch allocates it.

A legacy file is five pickles (magic number, protocol version, system information, the
object, the storage keys) followed by each storage's bytes. torch.load allocates every
storage at the size its pickle declares, and its unpickler reads each string at the length
the pickle declares, before anything is compared with the file. One flipped bit in a length
would allocate gigabytes (or fail for want of them). Two defences, both from the numbers:

- :class:`BoundedFile` is the file as torch reads it: no read asks for more bytes than are
  left, so a declared length costs at most the file's size.
- :func:`check_storage_claims` unpickles the object with nothing real behind its globals
  (every class or function it names is a harmless placeholder, so no code of the file's
  runs) and adds up the storages it declares. More bytes than the file holds is refused.

See [Note: file readers].
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from shardkit.core.errors import StateDictFileError, first_sentence

__all__ = ["BoundedFile", "check_storage_claims"]


class BoundedFile(io.RawIOBase):
    """A read-only binary file whose reads never ask for more than what is left in it."""

    def __init__(self, file: io.BufferedReader, size: int) -> None:
        super().__init__()
        self._file, self._size = file, size

    def readable(self) -> bool:  # noqa: D102 (io's protocol)
        return True

    def seekable(self) -> bool:  # noqa: D102
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:  # noqa: D102
        return self._file.seek(offset, whence)

    def tell(self) -> int:  # noqa: D102
        return self._file.tell()

    def _left(self) -> int:
        return max(0, self._size - self._file.tell())

    def read(self, size: int | None = -1) -> bytes:  # noqa: D102
        wanted = self._left() if size is None or size < 0 else min(size, self._left())
        return self._file.read(wanted)

    def readinto(self, buffer: Any) -> int:  # noqa: D102
        view = memoryview(buffer).cast("B")
        return self._file.readinto(view[: min(len(view), self._left())]) or 0


class _Placeholder:
    """Whatever the pickle builds from a global: takes any arguments, state, items."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:  # an OrderedDict's items
        pass

    def append(self, value: Any) -> None:  # a list subclass's items
        pass

    def extend(self, values: Any) -> None:
        pass


class _ClaimsUnpickler(pickle._Unpickler):
    """Unpickles with placeholders for globals, recording the storages that are declared.

    Python's unpickler, not C's: C's allocates a ``BINBYTES`` string at its declared length
    before reading it, Python's reads it (from a :class:`BoundedFile`, at most what is left).
    """

    def load_proto(self) -> None:
        """Any protocol number, as torch's unpickler takes it (Python's wants 5 or less)."""
        self.read(1)

    read: Callable[[int], bytes]  # set by pickle's load()

    def __init__(self, file: BoundedFile) -> None:
        super().__init__(file)
        self.storages: dict[str, tuple[str, int]] = {}  # key: (storage type name, numel)

    def find_class(self, module: str, name: str) -> Any:
        # A class of its own per global: a type (as NEWOBJ wants), named as the file named it.
        return type(name, (_Placeholder,), {})

    def persistent_load(self, pid: Any) -> Any:
        # torch's legacy persistent ids: ("storage", type, key, location, numel, view).
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] in ("storage", b"storage"):
            storage_type, key, numel = pid[1], pid[2], pid[4]
            if isinstance(numel, int) and isinstance(storage_type, type):
                self.storages.setdefault(str(key), (storage_type.__name__, numel))
        return _Placeholder()


# BYTEARRAY8 allocates its declared length first in both; torch never writes it.
_ClaimsUnpickler.dispatch = {
    **{k: v for k, v in pickle._Unpickler.dispatch.items() if k != pickle.BYTEARRAY8[0]},
    pickle.PROTO[0]: cast(Callable[[pickle.Unpickler], None], _ClaimsUnpickler.load_proto),
}


def _itemsizes() -> dict[str, int]:
    """Bytes per element of each storage type, by its name (``FloatStorage``: 4)."""
    # torch names no public map from storage type to dtype; file_formats uses the same one.
    names = torch.storage._dtype_to_storage_type_map()
    return {name: dtype.itemsize for dtype, name in names.items()}


def check_storage_claims(path: Path, file: BoundedFile, size: int) -> None:
    """Refuse a legacy file whose storages declare more bytes than the file holds.

    Raises:
        StateDictFileError: the pickles cannot be read, or a storage's declared size is
            negative, of an unknown type, or (all storages together) larger than the file.
    """
    itemsizes = _itemsizes()
    unpickler = _ClaimsUnpickler(file)
    try:
        for _ in range(4):  # magic number, protocol version, system information, the object
            unpickler.load()
    except Exception as error:  # a broken pickle raises many types (EOFError, KeyError, ...)
        raise StateDictFileError(
            f"{path} is not a readable torch.save file (legacy (non-zip) format, {size} "
            f"bytes): its pickle is broken ({type(error).__name__}: "
            f"{first_sentence(str(error))})"
        ) from None
    claimed = 0
    for key, (type_name, numel) in unpickler.storages.items():
        if type_name not in itemsizes or numel < 0:
            raise StateDictFileError(
                f"{path}: storage {key!r} is declared as {numel} elements of {type_name}, "
                f"which torch cannot load"
            )
        claimed += numel * itemsizes[type_name]
    if claimed > size:
        raise StateDictFileError(
            f"{path}: its storages declare {claimed} bytes, but the file holds {size} "
            f"(legacy (non-zip) format): the file is truncated or its sizes are damaged"
        )
