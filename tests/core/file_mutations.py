"""Hypothesis strategies that damage real state dict files: safetensors, zip and legacy ``.pt``.

Each strategy takes a valid file's bytes and draws one damaged copy. The generic mutations
(truncation, bit flips, byte runs inserted or removed, integers written over fields) aim at
the regions of the format where they matter: found from the file itself (the safetensors
length field, header and data; a zip archive's records, pickle and central directory; the
pickles and raw storages of torch's legacy format), so a flip lands in a length or an offset
as often as in tensor data. The safetensors header is also edited as JSON: a dtype, shape,
span or name changed, an entry dropped or added, the length field kept or fixed up.
"""

from __future__ import annotations

import io
import json
import pickletools
import struct
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch
from hypothesis import strategies as st

Region = tuple[int, int]
"""A byte span [start, end) of a file."""

# Values that break length and offset checks: zero, one, around 2**31 / 2**32 / 2**63 / 2**64
# (sign and width mistakes) and a terabyte (a hostile allocation).
_EDGE_INTS = [0, 1, 7, 8, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]
_DTYPE_NAMES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"]
_STRANGE_DTYPES = ["F33", "", "f32", "C64", "F8_E4M3", "U64", "F4", "STR"]


def rewrite_zip(
    raw: bytes,
    method: Callable[[str], int] = lambda _: zipfile.ZIP_STORED,
    replace: Mapping[str, bytes] | None = None,
) -> bytes:
    """A torch.save zip file written again by Python's zipfile, record by record.

    ``method`` gives each record's compression method by its name within the archive
    (``data/0``, ``data.pkl``); ``replace`` new contents for some of them. A valid file in
    another form than torch writes: torch.load reads it (DEFLATE included).
    """
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            name = info.filename.partition("/")[2]
            data = (replace or {}).get(name, source.read(info.filename))
            target.writestr(info.filename, data, compress_type=method(name))
    return out.getvalue()


def byteswapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in the other byte order (what a big-endian machine holds)."""
    size = tensor.element_size()
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).view(-1, size).flip(-1)
    return raw.contiguous().view(-1).view(tensor.dtype).view(tensor.shape)


def safetensors_regions(raw: bytes) -> list[Region]:
    """The length field, the JSON header and the data of a valid safetensors file."""
    (length,) = struct.unpack("<Q", raw[:8])
    regions = [(0, 8), (8, 8 + length)]
    if 8 + length < len(raw):
        regions.append((8 + length, len(raw)))
    return regions


def zip_regions(raw: bytes) -> list[Region]:
    """Each record's local header and data, the central directory and its end record."""
    archive = zipfile.ZipFile(io.BytesIO(raw))
    regions: list[Region] = []
    for info in archive.infolist():
        start = info.header_offset
        name_len, extra_len = struct.unpack("<HH", raw[start + 26 : start + 30])
        data = start + 30 + name_len + extra_len
        regions.append((start, data))  # the local header
        if info.compress_size:
            regions.append((data, data + info.compress_size))  # the record: pickle or storage
    end_record = raw.rfind(b"PK\x05\x06")
    regions += [(archive.start_dir, end_record), (end_record, len(raw))]
    return regions


def legacy_regions(raw: bytes) -> list[Region]:
    """The five pickles of torch's legacy format, then the raw storages after them."""
    stream = io.BytesIO(raw)
    regions: list[Region] = []
    for _ in range(5):  # magic number, protocol version, system info, the object, storage keys
        start = stream.tell()
        for _op in pickletools.genops(stream):
            pass
        regions.append((start, stream.tell()))
    regions.append((stream.tell(), len(raw)))
    return regions


@st.composite
def truncated(draw: st.DrawFn, raw: bytes) -> bytes:
    """The file cut short at any byte."""
    return raw[: draw(st.integers(0, len(raw) - 1))]


@st.composite
def bit_flips(draw: st.DrawFn, raw: bytes, regions: list[Region]) -> bytes:
    """One to four bits flipped, each in a region drawn first (so small regions are hit)."""
    out = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        start, end = draw(st.sampled_from(regions))
        out[draw(st.integers(start, end - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(out)


@st.composite
def spliced(draw: st.DrawFn, raw: bytes, regions: list[Region]) -> bytes:
    """A run of bytes removed, or arbitrary bytes inserted, inside a region."""
    start, end = draw(st.sampled_from(regions))
    at = draw(st.integers(start, end - 1))
    if draw(st.booleans()):
        return raw[:at] + raw[at + draw(st.integers(1, 16)) :]
    return raw[:at] + draw(st.binary(min_size=1, max_size=16)) + raw[at:]


@st.composite
def int_written(draw: st.DrawFn, raw: bytes, regions: list[Region]) -> bytes:
    """A little-endian integer (1, 2, 4 or 8 bytes; an edge value or any) written over bytes."""
    start, end = draw(st.sampled_from(regions))
    width: int = draw(st.sampled_from([1, 2, 4, 8]))
    at = draw(st.integers(start, max(start, end - width)))
    edge = st.sampled_from([*_EDGE_INTS, len(raw)])
    value: int = draw(st.one_of(edge, st.integers(0, 2**64 - 1)))
    packed = (value % (1 << (8 * width))).to_bytes(width, "little")
    return raw[:at] + packed + raw[at + width :]


def _junk() -> st.SearchStrategy[Any]:
    """JSON values of the wrong kind for any field."""
    return st.one_of(
        st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4), st.just({})
    )


def _size() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-2, 64), st.sampled_from(_EDGE_INTS), st.integers(0, 2**70))


@st.composite
def _edited_entry(draw: st.DrawFn, entry: dict[str, Any]) -> Any:
    """One tensor's header entry with one field changed (or made something else entirely)."""
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "whole"]))
    if field == "whole":
        return draw(_junk())
    edited = dict(entry)
    if field == "dtype":
        names = st.sampled_from(_DTYPE_NAMES + _STRANGE_DTYPES)
        edited["dtype"] = draw(st.one_of(names, _junk()))
    elif field == "shape":
        edited["shape"] = draw(st.one_of(st.lists(_size(), max_size=3), _junk()))
    else:
        begin, end = entry["data_offsets"]
        offsets = st.one_of(
            st.tuples(_size(), st.just(end)).map(list),
            st.tuples(st.just(begin), _size()).map(list),
            st.lists(_size(), max_size=3),
            _junk(),
        )
        edited["data_offsets"] = draw(offsets)
    return edited


@st.composite
def header_edited(draw: st.DrawFn, raw: bytes) -> bytes:
    """The JSON header edited: a field, a name, an entry dropped or added, ``__metadata__``."""
    (length,) = struct.unpack("<Q", raw[:8])
    header: dict[str, Any] = json.loads(raw[8 : 8 + length])
    names = [n for n in header if n != "__metadata__"]
    name = draw(st.sampled_from(names))
    edit = draw(st.sampled_from(["entry", "rename", "drop", "add", "metadata"]))
    if edit == "entry":
        header[name] = draw(_edited_entry(header[name]))
    elif edit == "rename":
        header[draw(st.text(min_size=1, max_size=8))] = header.pop(name)
    elif edit == "drop":
        del header[name]
    elif edit == "add":
        header[name + ".extra"] = draw(_edited_entry(header[name]))
    else:
        header["__metadata__"] = draw(st.one_of(_junk(), st.dictionaries(st.text(), _junk())))
    body = json.dumps(header).encode()
    # Usually the length field follows the edit, so the edit itself is what gets checked.
    new_length = len(body) if draw(st.booleans()) else length
    return struct.pack("<Q", new_length) + body + raw[8 + length :]


def safetensors_mutations(raw: bytes) -> st.SearchStrategy[bytes]:
    """Every mutation of a safetensors file."""
    regions = safetensors_regions(raw)
    return st.one_of(
        truncated(raw),
        bit_flips(raw, regions),
        spliced(raw, regions),
        int_written(raw, regions),
        header_edited(raw),
    )


# Fields of a central directory entry that say how to read the record: (offset, width).
_CENTRAL_FIELDS = {"flags": (8, 2), "method": (10, 2), "compressed": (20, 4), "size": (24, 4)}
# Compression methods: stored, shrunk, DEFLATE, Deflate64, bzip2, LZMA, Zstandard, unknown.
_METHODS = [0, 1, 8, 9, 12, 14, 93, 0xFFFF]


def _central_entries(raw: bytes) -> list[int]:
    """Where each central directory entry starts."""
    archive = zipfile.ZipFile(io.BytesIO(raw))
    starts, position = [], archive.start_dir
    for _ in archive.infolist():
        starts.append(position)
        lengths = struct.unpack("<3H", raw[position + 28 : position + 34])
        position += 46 + sum(lengths)
    return starts


@st.composite
def record_edited(draw: st.DrawFn, raw: bytes) -> bytes:
    """One record's way of being read changed in the central directory (what torch obeys).

    Its compression method, its flags (the encryption bits among them), or its compressed or
    uncompressed size, set to a value near the old one or an edge.
    """
    start = draw(st.sampled_from(_central_entries(raw)))
    field = draw(st.sampled_from(sorted(_CENTRAL_FIELDS)))
    offset, width = _CENTRAL_FIELDS[field]
    (old,) = struct.unpack(
        "<H" if width == 2 else "<L", raw[start + offset : start + offset + width]
    )
    if field == "method":
        value: int = draw(st.sampled_from(_METHODS))
    elif field == "flags":
        value = old ^ (1 << draw(st.integers(0, 15)))
    else:
        near = st.integers(max(0, old - 16), old + 16)
        value = draw(st.one_of(near, st.sampled_from(_EDGE_INTS), st.integers(0, 2**32 - 1)))
    packed = (value % (1 << (8 * width))).to_bytes(width, "little")
    return raw[: start + offset] + packed + raw[start + offset + width :]


def torch_mutations(raw: bytes) -> st.SearchStrategy[bytes]:
    """Every mutation of a torch.save file, zip or legacy."""
    is_zip = raw.startswith(b"PK\x03\x04")
    regions = zip_regions(raw) if is_zip else legacy_regions(raw)
    generic = [
        truncated(raw),
        bit_flips(raw, regions),
        spliced(raw, regions),
        int_written(raw, regions),
    ]
    return st.one_of(*generic, record_edited(raw)) if is_zip else st.one_of(*generic)
