"""Where a safetensors file goes wrong, for the error message when the library refuses it.

The safetensors library decides whether a file is valid; this module only explains a file it
refused, because its messages do not always say which tensor is at fault ("invalid shape,
data type, or offset for tensor"). The checks follow the format: an 8-byte little-endian header
length, a JSON object of tensors (``dtype``, ``shape``, ``data_offsets`` relative to the data
section) and an optional ``__metadata__`` of strings, then the tensors' bytes, back to back,
in offset order, covering the data section exactly. See [Note: file readers].

Memory stays bounded whatever the file claims: the header is read only when it is smaller
than both the file and the library's own limit, and spans are compared as numbers.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from shardkit.core.formats.file_writers import SAFETENSORS_DTYPES

__all__ = ["MAX_HEADER_BYTES", "explain_safetensors"]

MAX_HEADER_BYTES = 100_000_000
"""The largest header the safetensors library accepts."""

_ITEMSIZE = {name: dtype.itemsize for dtype, name in SAFETENSORS_DTYPES.items()}


def explain_safetensors(path: str | os.PathLike[str]) -> str:
    """What is wrong with the safetensors file at ``path``, and where; '' if nothing is found."""
    size = Path(path).stat().st_size
    if size < 8:
        return f"it holds {size} bytes, less than the 8-byte header length that starts the format"
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(MAX_HEADER_BYTES, size - 8):
            return (
                f"its header length field says {length} bytes, but the file holds {size - 8} "
                f"bytes after it (and headers are limited to {MAX_HEADER_BYTES} bytes)"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        return f"its header is not UTF-8 text (byte {8 + error.start} of the file)"
    except json.JSONDecodeError as error:
        return f"its header is not JSON ({error.msg} at byte {8 + error.pos} of the file)"
    except (ValueError, RecursionError) as error:  # a 5000-digit number, arrays nested deep
        return f"its header is JSON that cannot be read ({error})"
    if not isinstance(header, dict):
        return f"its header is a JSON {type(header).__name__}, not an object of tensors"
    return _explain_entries(header, data_bytes=size - 8 - length)


def _explain_entries(header: dict[str, Any], *, data_bytes: int) -> str:
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        return "its __metadata__ is not an object of strings"
    for name, info in header.items():
        problem = _shape_problem(info)
        if problem:
            return f"tensor {name!r} {problem}"
    cursor = 0
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        needed = math.prod(info["shape"]) * _ITEMSIZE[info["dtype"]]
        if begin != cursor:
            return (
                f"tensor {name!r} starts at data byte {begin}, but the one before ends at {cursor}"
            )
        if end > data_bytes:
            return (
                f"tensor {name!r} ends at data byte {end}, past the end of the file's "
                f"{data_bytes} data bytes (the file is truncated, or its offsets are wrong)"
            )
        if end - begin != needed:
            return (
                f"tensor {name!r} spans {end - begin} bytes (data_offsets [{begin}, {end}]), but "
                f"shape {info['shape']} x {info['dtype']} needs {needed}"
            )
        cursor = end
    if cursor != data_bytes:
        return f"its tensors end at data byte {cursor}, but the file holds {data_bytes} data bytes"
    return ""


def _shape_problem(info: Any) -> str:
    """What is malformed in one tensor's header entry ('' if nothing)."""
    if not isinstance(info, dict):
        return "is described by a JSON value that is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        return f"has dtype {dtype!r}, which is not one torch can load ({', '.join(_ITEMSIZE)})"
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"has shape {shape!r}, not a list of sizes"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        return f"has data_offsets {offsets!r}, not [begin, end]"
    if offsets[1] < offsets[0]:
        return f"has data_offsets {offsets} that end before they begin"
    return ""


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
