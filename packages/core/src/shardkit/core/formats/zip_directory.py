"""A zip archive's central directory, placed where torch's zip reader places it.

torch's reader (miniz) reads the central directory at the offset its end record gives.
Python's ``zipfile`` instead assumes the directory ends right where the end record starts,
and shifts every offset by the difference (to read archives with bytes prepended): a file
with a byte inserted before its end record is one torch reads correctly and Python does not
read at all. So the end record is read here, the directory taken from where it says, and
Python's parser given that directory alone, followed by an end record that puts it at the
start: nothing is shifted, and each record's offset is the file's own.
"""

from __future__ import annotations

import io
import struct
import zipfile
from typing import BinaryIO

__all__ = ["NoEndRecord", "read_central_directory"]

_END = struct.Struct("<4s4H2LH")  # signature, disks, entries (this disk, all), size, offset
_END_SIGNATURE = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sLQL")  # zip64 end record locator: signature, disk, offset, disks
_LOCATOR_SIGNATURE = b"PK\x06\x07"
_END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end record, up to the directory's offset
_END64_SIGNATURE = b"PK\x06\x06"
_MAX_COMMENT = 0xFFFF  # the end record may be followed by a comment this long


class NoEndRecord(zipfile.BadZipFile):
    """The file has no zip end record: not a zip archive, or one cut short."""


def read_central_directory(f: BinaryIO, size: int) -> list[zipfile.ZipInfo]:
    """Every record the central directory lists, with the file's own offsets.

    Raises:
        NoEndRecord: no end record within the file's last 64 KiB.
        zipfile.BadZipFile: the end record or the directory is damaged (what is wrong).
    """
    tail_start = max(0, size - _END.size - _MAX_COMMENT)
    f.seek(tail_start)
    tail = f.read()
    at = tail.rfind(_END_SIGNATURE)
    if at < 0 or len(tail) - at < _END.size:
        raise NoEndRecord("no zip end record")
    end = _END.unpack_from(tail, at)
    count, directory_size, offset = end[4], end[5], end[6]
    if tail_start + at >= _LOCATOR.size:
        f.seek(tail_start + at - _LOCATOR.size)
        locator = _LOCATOR.unpack(f.read(_LOCATOR.size))
        if locator[0] == _LOCATOR_SIGNATURE:
            zip64 = _zip64_end(f, size, locator[2])
            if zip64 is not None:
                count, directory_size, offset = zip64
    if offset + directory_size > size:
        raise zipfile.BadZipFile(
            f"the end record puts the central directory at bytes {offset} to "
            f"{offset + directory_size}, past the end of the file ({size} bytes)"
        )
    f.seek(offset)
    directory = f.read(directory_size)
    with zipfile.ZipFile(io.BytesIO(directory + _end_record(count, directory_size))) as archive:
        return archive.infolist()


def _zip64_end(f: BinaryIO, size: int, at: int) -> tuple[int, int, int] | None:
    """(entries, directory size, directory offset) from a zip64 end record.

    None where the locator points at something else: the end record's own numbers then
    stand, as in torch's reader.
    """
    if at + _END64.size > size:
        raise zipfile.BadZipFile(f"the zip64 end record at byte {at} is past the end of the file")
    f.seek(at)
    record = _END64.unpack(f.read(_END64.size))
    if record[0] != _END64_SIGNATURE:
        return None
    return record[7], record[8], record[9]


def _end_record(count: int, directory_size: int) -> bytes:
    """An end record for a directory at offset 0 (zip64 when the numbers need it)."""
    if count < 0xFFFF and directory_size < 0xFFFFFFFF:
        return _END.pack(_END_SIGNATURE, 0, 0, count, count, directory_size, 0, 0)
    end64 = _END64.pack(
        _END64_SIGNATURE, _END64.size - 12, 45, 45, 0, 0, count, count, directory_size, 0
    )
    locator = _LOCATOR.pack(_LOCATOR_SIGNATURE, 0, directory_size, 1)
    end = _END.pack(_END_SIGNATURE, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return end64 + locator + end
