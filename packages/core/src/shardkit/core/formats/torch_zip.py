"""torch.save's zip format: every record a load depends on, checked before torch reads it.

torch.load reads a zip file two ways. Unmapped, its zip reader (miniz) finds each record
through the central directory, decompresses it if it is DEFLATE-compressed, and refuses a
storage whose record is not the size the pickle declares. Memory-mapped, it takes each
record's offset from its local header and slices the map there, trusting the rest: a
compressed record would load as its compressed bytes, a record of the wrong size as whatever
bytes follow it. So before a file is mapped, this module checks:

- the archive: its central directory is there (read where torch's reader finds it,
  ``zip_directory.py``), and every record's local header and data lie inside the file (what
  the unmapped load checks and the mapped one does not);
- the pickle (``data.pkl``, read by torch's own zip reader): every storage it declares has
  its record, stored plainly (method STORED) or DEFLATE-compressed, not encrypted, holding
  exactly the bytes declared (numel x element size), naming the tensor otherwise;
- a compressed record decompresses to exactly its declared size (torch's reader leaves the
  rest of its buffer uninitialized when a damaged record gives less), which it cannot declare
  larger than DEFLATE can expand (1032 times): torch's allocation of the declared size is
  bounded by the file.

The file is mapped only when every storage record is stored plainly; otherwise torch reads it
unmapped, and decompresses. See [Note: file readers].
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from shardkit.core.errors import StateDictFileError, first_sentence
from shardkit.core.formats.torch_pickle import StorageClaim, read_storage_claims
from shardkit.core.formats.zip_directory import NoEndRecord, read_central_directory

__all__ = ["ZipCheck", "ZIP_MAGIC", "check_zip"]

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format is a zip archive
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip record's local header, before its name
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "DEFLATE"}
_METHOD_NAMES = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "LZMA", 93: "Zstandard"}
# Bit 0: encrypted; bit 6: strong encryption (the zip specification's general purpose flags).
_ENCRYPTED = 0x0001 | 0x0040
_CHUNK = 2**20  # compressed bytes read at a time to check a record
# DEFLATE's largest expansion: a 258-byte match in two bits, so 1032 bytes out per byte in.
_DEFLATE_MAX_RATIO = 1032


@dataclass(frozen=True, slots=True)
class ZipCheck:
    """What the checks found that decides how the file is read."""

    compressed: list[str]
    """The storage records that are DEFLATE-compressed: the file cannot be mapped."""

    @property
    def mappable(self) -> bool:
        """Whether every storage record is stored plainly (a slice of the file)."""
        return not self.compressed


def check_zip(path: Path, size: int) -> ZipCheck:
    """Check a torch.save zip file's records against its pickle's declarations.

    Raises:
        StateDictFileError: naming the file, and the record or tensor at fault.
    """
    infos = _check_archive(path, size)
    prefix = infos[0].filename.partition("/")[0]  # torch's records are under one folder
    by_name: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        by_name.setdefault(info.filename, info)
    pickle_info = by_name.get(f"{prefix}/data.pkl")
    if pickle_info is None:
        raise StateDictFileError(f"{path}: no record {prefix}/data.pkl (torch.save's pickle)")
    with open(path, "rb") as f:
        for info in infos:  # torch's reader allocates a record's declared size to read it
            if info.compress_type == zipfile.ZIP_DEFLATED:
                _check_inflates(path, info, f)
            elif info.compress_type == zipfile.ZIP_STORED and (
                _data_start(info, f) + info.file_size > size
            ):
                # torch reads a stored record's declared size, whatever it stored.
                raise StateDictFileError(
                    f"{path}: record {info.filename} declares {info.file_size} bytes, past the "
                    f"end of the file: its size is damaged"
                )
    _check_readable(path, pickle_info)
    compressed: list[str] = []
    for claim in _claims(path, size):
        record = by_name.get(f"{prefix}/data/{claim.key}")
        if record is None:
            raise StateDictFileError(
                f"{path}: tensor {claim.tensor!r} is stored in record "
                f"{prefix}/data/{claim.key}, which the file does not have"
            )
        _check_size(path, record, claim)
        _check_readable(path, record)
        if record.compress_type != zipfile.ZIP_STORED:
            compressed.append(record.filename)
    return ZipCheck(compressed)


def _check_archive(path: Path, size: int) -> list[zipfile.ZipInfo]:
    """The archive has its central directory, and every record its local header and data.

    torch.load without a memory map refuses a record whose local header lost its signature,
    but with one it takes the records' offsets on trust and would read whatever bytes are
    there. This checks what the unmapped load checks (the signature; the header's name and
    extra lengths, which place the data), reading 30 bytes a record.
    """
    try:
        with open(path, "rb") as f:
            infos = read_central_directory(f, size)
            for info in infos:
                _check_local_header(info, f, size)
    except NoEndRecord:
        raise StateDictFileError(
            f"{path} starts as a zip archive (torch.save's format) but has no central "
            f"directory at its end ({size} bytes): the file is truncated"
        ) from None
    except (zipfile.BadZipFile, NotImplementedError, ValueError, OSError) as error:
        raise StateDictFileError(
            f"{path} is a damaged zip archive (torch.save's format): {error}"
        ) from None
    if not infos:
        raise StateDictFileError(f"{path} is an empty zip archive, not a torch.save file")
    return infos


def _check_local_header(info: zipfile.ZipInfo, f: BinaryIO, size: int) -> None:
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or not header.startswith(ZIP_MAGIC):
        raise zipfile.BadZipFile(
            f"record {info.filename!r} has no local header at byte {info.header_offset}"
        )
    *_, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    end = info.header_offset + len(header) + name_len + extra_len + info.compress_size
    if end > size:
        raise zipfile.BadZipFile(
            f"record {info.filename!r} ends at byte {end}, past the end of the file"
        )


def _check_readable(path: Path, info: zipfile.ZipInfo) -> None:
    """A record torch will read is stored or DEFLATE-compressed, and not encrypted."""
    method = info.compress_type
    if method not in _METHODS:
        name = _METHOD_NAMES.get(method, "unknown")
        raise StateDictFileError(
            f"{path}: record {info.filename} is compressed with zip method {method} ({name}); "
            f"torch reads only stored or DEFLATE-compressed records"
        )
    if info.flag_bits & _ENCRYPTED:
        raise StateDictFileError(f"{path}: record {info.filename} is encrypted")


def _check_inflates(path: Path, info: zipfile.ZipInfo, f: BinaryIO) -> None:
    """A DEFLATE record decompresses to exactly its declared size, which DEFLATE can reach.

    torch's reader decompresses into a buffer of the declared size and does not check that
    the data filled it: a damaged record would leave uninitialized memory in the tensor.
    """
    if info.file_size > info.compress_size * _DEFLATE_MAX_RATIO:
        raise StateDictFileError(
            f"{path}: record {info.filename} declares {info.file_size} bytes from "
            f"{info.compress_size} compressed, more than DEFLATE can expand to: its size is "
            f"damaged"
        )
    inflated = _inflated_size(info, f)
    if inflated != info.file_size:
        raise StateDictFileError(
            f"{path}: record {info.filename} is damaged: it declares {info.file_size} bytes, "
            f"its compressed data decompresses to {inflated}"
        )


def _inflated_size(info: zipfile.ZipInfo, f: BinaryIO) -> int | str:
    """Bytes a DEFLATE record decompresses to, up to one more than declared; or the error.

    Decompressed a chunk at a time and let go (memory: about a chunk), counting the bytes.
    """
    f.seek(_data_start(info, f))
    inflate = zlib.decompressobj(-zlib.MAX_WBITS)  # raw DEFLATE, as zip stores it
    left, produced = info.compress_size, 0
    try:
        while produced <= info.file_size:
            data = inflate.unconsumed_tail  # input held back when the output limit was hit
            if not data and left:
                data = f.read(min(left, _CHUNK))
                left = left - len(data) if data else 0
            out = inflate.decompress(data, min(_CHUNK, info.file_size + 1 - produced))
            produced += len(out)
            if not out and not inflate.unconsumed_tail and not left:
                break
    except zlib.error as error:
        return f"{produced} bytes, then fails ({error})"
    return f"more than {info.file_size} bytes" if produced > info.file_size else produced


def _data_start(info: zipfile.ZipInfo, f: BinaryIO) -> int:
    """Where a record's data starts: after its local header's name and extra field."""
    f.seek(info.header_offset + 26)
    name_len, extra_len = struct.unpack("<2H", f.read(4))
    return int(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)


def _claims(path: Path, size: int) -> list[StorageClaim]:
    """The storages the pickle declares, read through torch's own zip reader."""
    try:
        # torch's reader, not Python's zipfile: the same bytes torch.load will unpickle.
        raw = torch._C.PyTorchFileReader(str(path)).get_record("data.pkl")
        return read_storage_claims(io.BytesIO(raw), pickles=1)
    except Exception as error:  # miniz's RuntimeError, or a broken pickle's many types
        raise StateDictFileError(
            f"{path} is not a readable torch.save file (zip format, {size} bytes): its "
            f"pickle (data.pkl) cannot be read ({type(error).__name__}: "
            f"{first_sentence(str(error))})"
        ) from None


def _check_size(path: Path, info: zipfile.ZipInfo, claim: StorageClaim) -> None:
    """The record holds exactly the storage's declared bytes, as the unmapped load checks."""
    declared = claim.nbytes()
    if declared is None:
        raise StateDictFileError(
            f"{path}: tensor {claim.tensor!r} has a storage declared as {claim.numel} "
            f"elements of {claim.type_name}, which torch cannot load"
        )
    if declared != info.file_size:
        raise StateDictFileError(
            f"{path}: tensor {claim.tensor!r}: record {info.filename} holds {info.file_size} "
            f"bytes, but its storage is declared as {declared} ({claim.numel} elements of "
            f"{claim.type_name})"
        )
