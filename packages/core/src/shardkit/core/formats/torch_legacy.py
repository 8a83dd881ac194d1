"""torch.save's legacy (non-zip) format: what a file claims, checked before torch allocates it.

A legacy file is five pickles (magic number, protocol version, system information, the
object, the storage keys) followed by each storage's bytes. torch.load allocates every
storage at the size its pickle declares, and its unpickler reads each string at the length
the pickle declares, before anything is compared with the file. One flipped bit in a length
would allocate gigabytes (or fail for want of them). Two defences, both from the numbers:

- :class:`BoundedFile` is the file as torch reads it: no read asks for more bytes than are
  left, so a declared length costs at most the file's size.
- :func:`check_storage_claims` reads the object's pickle with nothing real behind its
  globals (``torch_pickle.py``: no code of the file's runs) and adds up the storages it
  declares. More bytes than the file holds is refused. Then it walks the storages' bytes:
  each declared storage must be listed (torch leaves one that is not uninitialized, and
  loads whatever memory held) and hold the declared element count, inside the file.

See [Note: file readers].
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

from shardkit.core.errors import StateDictFileError, first_sentence
from shardkit.core.formats.torch_pickle import StorageClaim, read_pickle, read_storage_claims

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


def check_storage_claims(path: Path, file: BoundedFile, size: int) -> None:
    """Refuse a legacy file whose storages are not what its pickle declares.

    Raises:
        StateDictFileError: the pickles cannot be read; a storage's declared size is
            negative, of an unknown type, or (all storages together) larger than the file; a
            declared storage is not listed among those whose bytes follow, or its bytes hold
            another element count or run past the end of the file.
    """
    try:
        # magic number, protocol version, system information, then the object
        claims = read_storage_claims(file, pickles=4)
        listed = read_pickle(file)  # the storage keys, in the order their bytes follow
    except Exception as error:  # a broken pickle raises many types (EOFError, KeyError, ...)
        raise StateDictFileError(
            f"{path} is not a readable torch.save file (legacy (non-zip) format, {size} "
            f"bytes): its pickle is broken ({type(error).__name__}: "
            f"{first_sentence(str(error))})"
        ) from None
    claimed = 0
    for claim in claims:
        nbytes = claim.nbytes()
        if nbytes is None:
            raise StateDictFileError(
                f"{path}: storage {claim.key!r} (of tensor {claim.tensor!r}) is declared as "
                f"{claim.numel} elements of {claim.type_name}, which torch cannot load"
            )
        claimed += nbytes
    if claimed > size:
        raise StateDictFileError(
            f"{path}: its storages declare {claimed} bytes, but the file holds {size} "
            f"(legacy (non-zip) format): the file is truncated or its sizes are damaged"
        )
    _check_storage_bytes(path, file, size, claims, listed)


_COUNT = struct.Struct("<q")  # each storage's bytes follow its element count


def _int64(value: int) -> int:
    """``value`` as a signed 64-bit integer holds it (wrapped)."""
    return (value + 2**63) % 2**64 - 2**63


def _check_storage_bytes(
    path: Path, file: BoundedFile, size: int, claims: list[StorageClaim], listed: Any
) -> None:
    """Each declared storage is listed, and its bytes are the declared count, in the file."""
    by_key = {claim.key: claim for claim in claims}
    if not isinstance(listed, (list, tuple)) or not all(isinstance(k, str) for k in listed):
        raise StateDictFileError(f"{path}: its list of storage keys is damaged")
    unlisted = [c for key, c in by_key.items() if key not in listed]
    if unlisted or set(listed) - set(by_key):
        where = f" (storage {unlisted[0].key!r} of tensor {unlisted[0].tensor!r})"
        raise StateDictFileError(
            f"{path}: its storage keys do not match the storages its pickle declares"
            f"{where if unlisted else ''} (legacy (non-zip) format): the file is damaged"
        )
    for key in listed:
        claim = by_key[key]
        raw = file.read(_COUNT.size)
        (count,) = _COUNT.unpack(raw) if len(raw) == _COUNT.size else (None,)
        # torch multiplies the count by the element size in 64 bits and compares bytes: a
        # count damaged in its high bits can still give the declared bytes, which it reads.
        nbytes = None if count is None else _int64(count * (claim.itemsize() or 0))
        end = file.tell() + (nbytes or 0)
        if nbytes != claim.nbytes() or end > size:
            found = "nothing" if count is None else f"{count} elements"
            raise StateDictFileError(
                f"{path}: storage {key!r} (of tensor {claim.tensor!r}) holds {found} at byte "
                f"{file.tell()}, its pickle declares {claim.numel} ({size} bytes in the file)"
            )
        file.seek(end)
