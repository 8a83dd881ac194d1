"""Exports on the wire: one JSON header and one raw payload per message, never pickle.

A transport that crosses processes (shared memory, a receiver group) moves a manifest or a
bucket as a UTF-8 JSON header plus one flat run of bytes: the tensors' own bytes, contiguous,
little-endian as torch stores them, each at an offset aligned to :data:`ALIGN` (so the receiver
views them in place, no copy). The other process is not trusted: :func:`decode_manifest` and
:func:`decode_bucket` check every field (types, sizes, offsets, dtype names from an allow-list,
names against the manifest, the total) before any tensor is built, and raise
:class:`~shardkit.core.errors.WeightLoadError` naming what is wrong.

A delta export's changed elements go in the smaller of two encodings, per tensor: int32 flat
positions (4 bytes a change; only for tensors under 2**31 elements) or a bitmask over the whole
tensor (one bit an element, bit ``j`` of byte ``i`` for element ``8 * i + j``), then the values.
Either decodes to int64 ascending positions. A bitmask's size comes from the tensor's numel,
which the manifest gives: decoding a bucket needs its manifest. Changes sent as *steps* of
their bits (``ChangedElements.stepped``) add a second set of positions, in the same
encodings, and the steps, int8 where all fit (int64 otherwise).

Next to split off: the changed elements' records (``_encode_positions``, ``_encode_steps``,
``_decode_changes``, ``_decode_positions``), into a module of their own with the checks they
share (``_PayloadReader`` with them).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import (
    ChangedElements,
    ExportedTensor,
    ExportManifest,
    WeightBucket,
)

__all__ = [
    "ALIGN",
    "WIRE_DTYPES",
    "WIRE_VERSION",
    "EncodedMessage",
    "decode_bucket",
    "decode_manifest",
    "encode_bucket",
    "encode_manifest",
    "largest_full_payload",
]

WIRE_VERSION = 1
ALIGN = 64
"""Every region of a payload starts at a multiple of this (any dtype views it in place)."""

WIRE_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
        torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool,
    )
}  # fmt: skip
"""The dtypes an export may carry, by their names on the wire."""

_INDEX32_LIMIT = 2**31
_MANIFEST_KEYS = {"type", "version", "export_id", "kind", "bucket_count", "tensors"}
_ENTRY_KEYS = {"name", "shape", "dtype", "bucket"}
_BUCKET_KEYS = {"type", "version", "export_id", "index", "payload_bytes", "full", "changed"}
_FULL_KEYS = {"name", "data"}
_CHANGED_KEYS = {"name", "count", "encoding", "positions", "values", "stepped"}
_STEPPED_KEYS = {"count", "encoding", "positions", "width", "steps"}
_REGION_KEYS = {"offset", "nbytes"}


@dataclass(frozen=True, slots=True)
class EncodedMessage:
    """A message ready to send: its header, and where each source's bytes go in the payload."""

    header: bytes
    """The UTF-8 JSON header."""
    payload_bytes: int
    """The payload's exact size in bytes (0 for a manifest)."""
    parts: tuple[tuple[int, torch.Tensor], ...] = ()
    """(offset, 1-D uint8 view of the source bytes), in offset order."""

    def write_payload(self, out: torch.Tensor) -> None:
        """Write the payload into ``out[:payload_bytes]`` (1-D uint8, on any device)."""
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < self.payload_bytes:
            raise ValueError(f"write_payload: {self.payload_bytes}+ uint8s due, not {out.shape}")
        cursor = 0
        for offset, source in self.parts:
            out[cursor:offset].zero_()  # the alignment gaps: never stale memory on the wire
            out[offset : offset + source.numel()].copy_(source)
            cursor = offset + source.numel()
        out[cursor : self.payload_bytes].zero_()

    def payload(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The payload as a new 1-D uint8 tensor on ``device``."""
        out = torch.empty(self.payload_bytes, dtype=torch.uint8, device=device)
        self.write_payload(out)
        return out


def encode_manifest(manifest: ExportManifest) -> EncodedMessage:
    """The manifest as a header (no payload)."""
    for entry in manifest.tensors:
        if _wire_name(entry.dtype) is None:
            raise WeightExportError(f"{entry.name}: dtype {entry.dtype} cannot go on the wire")
    tensors = [
        dict(name=t.name, shape=list(t.shape), dtype=_wire_name(t.dtype), bucket=t.bucket)
        for t in manifest.tensors
    ]
    header = dict(type="manifest", version=WIRE_VERSION, export_id=manifest.export_id)
    header |= dict(kind=manifest.kind, bucket_count=manifest.bucket_count, tensors=tensors)
    return EncodedMessage(json.dumps(header).encode(), 0)


def encode_bucket(bucket: WeightBucket, manifest: ExportManifest) -> EncodedMessage:
    """Bucket ``bucket`` of ``manifest``'s export as a header and the plan of its payload.

    Changed elements go as int32 positions or as a bitmask, whichever is smaller for the tensor.

    Raises:
        WeightExportError: the bucket does not match the manifest (names, shapes, dtypes), or its
            changed elements are not ascending positions inside the tensor.
    """
    if sys.byteorder != "little":
        raise WeightExportError("the export wire format is little-endian; this host is not")
    entries = manifest.by_name()
    parts: list[tuple[int, torch.Tensor]] = []
    cursor = 0

    def place(source: torch.Tensor) -> dict[str, int]:
        nonlocal cursor
        offset = _aligned(cursor)
        parts.append((offset, source))
        cursor = offset + source.numel()
        return {"offset": offset, "nbytes": source.numel()}

    full = []
    for name, tensor in bucket.full:
        entry = _sent_entry(entries, name, bucket.index)
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise WeightExportError(
                f"bucket {bucket.index}: {name} is {list(tensor.shape)} {tensor.dtype}, the "
                f"manifest says {list(entry.shape)} {entry.dtype}"
            )
        full.append({"name": name, "data": place(_as_bytes(tensor))})
    changed = []
    for name, changes in bucket.changed:
        entry = _sent_entry(entries, name, bucket.index)
        encoding, positions = _encode_positions(changes, entry, bucket.index)
        record = dict(name=name, count=changes.indices.numel(), encoding=encoding)
        record |= dict(positions=place(positions), values=place(_as_bytes(changes.values)))
        record["stepped"] = _encode_steps(changes, entry, bucket.index, place)
        changed.append(record)
    header = dict(type="bucket", version=WIRE_VERSION, export_id=manifest.export_id)
    header |= dict(index=bucket.index, payload_bytes=cursor, full=full, changed=changed)
    return EncodedMessage(json.dumps(header).encode(), cursor, tuple(parts))


def largest_full_payload(manifest: ExportManifest) -> int:
    """The payload bytes of the manifest's largest bucket sent whole (a buffer's size)."""
    sizes = [0] * max(manifest.bucket_count, 1)
    for entry in manifest.tensors:
        nbytes = math.prod(entry.shape) * entry.dtype.itemsize
        sizes[entry.bucket] = _aligned(sizes[entry.bucket]) + nbytes
    return max(sizes)


def decode_manifest(header: bytes) -> ExportManifest:
    """A manifest from its header, every field checked.

    Raises:
        WeightLoadError: the header is not a well-formed manifest.
    """
    raw = _message(header, "manifest", _MANIFEST_KEYS)
    export_id = _int(raw["export_id"], "manifest export_id")
    bucket_count = _int(raw["bucket_count"], "manifest bucket_count")
    kind = raw["kind"]
    if kind not in ("full", "delta"):
        raise WeightLoadError(f"manifest kind {kind!r} is neither 'full' nor 'delta'")
    tensors: list[ExportedTensor] = []
    seen: set[str] = set()
    for item in _list(raw["tensors"], "manifest tensors"):
        where = f"manifest entry {len(tensors)}"
        item = _object(item, _ENTRY_KEYS, where)
        name = _name(item["name"], where)
        if name in seen:
            raise WeightLoadError(f"manifest names {name!r} twice")
        seen.add(name)
        dims = tuple(_int(d, f"{name}: a dim of the shape") for d in _list(item["shape"], name))
        bucket = _int(item["bucket"], f"{name}: bucket")
        if bucket >= bucket_count:
            raise WeightLoadError(f"{name}: bucket {bucket} of {bucket_count}")
        tensors.append(ExportedTensor(name, dims, _dtype(item["dtype"], name), bucket))
    return ExportManifest(export_id, kind, tuple(tensors), bucket_count)


def decode_bucket(header: bytes, payload: torch.Tensor, manifest: ExportManifest) -> WeightBucket:
    """A bucket of ``manifest``'s export from its header and payload, every field checked.

    The tensors are views of ``payload`` (no copy): they are valid while it is.

    Args:
        header: the bucket's UTF-8 JSON header.
        payload: its bytes, 1-D uint8 of exactly the header's ``payload_bytes`` (any device).
        manifest: the export's manifest (names, shapes, dtypes, each tensor's bucket).

    Raises:
        WeightLoadError: the header, the payload or the changed positions are malformed, or the
            bucket does not match the manifest.
    """
    raw = _message(header, "bucket", _BUCKET_KEYS)
    index = _int(raw["index"], "bucket index")
    where = f"export {manifest.export_id} bucket {index}"
    if _int(raw["export_id"], f"{where}: export_id") != manifest.export_id:
        raise WeightLoadError(f"{where}: belongs to export {raw['export_id']}")
    size = _int(raw["payload_bytes"], f"{where}: payload_bytes")
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != size:
        raise WeightLoadError(
            f"{where}: the header says {size} payload bytes, got {payload.numel()} "
            f"({payload.dtype}, {payload.dim()}-D)"
        )
    full, changed = _list(raw["full"], where), _list(raw["changed"], where)
    if (full and manifest.kind != "full") or (changed and manifest.kind != "delta"):
        raise WeightLoadError(f"{where}: a {manifest.kind} export's bucket holds the other kind")
    reader = _PayloadReader(payload, where)
    entries = manifest.by_name()
    names: list[str] = []

    def entry_of(record: object, keys: set[str]) -> tuple[dict[str, Any], ExportedTensor]:
        item = _object(record, keys, f"{where}: a tensor record")
        name = _name(item["name"], where)
        entry = entries.get(name)
        if entry is None or entry.bucket != index or name in names:
            raise WeightLoadError(f"{where}: {name!r} is not in this bucket, or is sent twice")
        names.append(name)
        return item, entry

    tensors = []
    for record in full:
        item, entry = entry_of(record, _FULL_KEYS)
        numel = math.prod(entry.shape)
        data = reader.region(item["data"], entry.name, numel * entry.dtype.itemsize)
        tensors.append((entry.name, data.view(entry.dtype).view(entry.shape)))
    deltas = []
    for record in changed:
        item, entry = entry_of(record, _CHANGED_KEYS)
        deltas.append((entry.name, _decode_changes(item, entry, reader)))
    if sorted(names) != sorted(manifest.names_in(index)):
        raise WeightLoadError(
            f"{where}: holds {sorted(names)}, the manifest lists {manifest.names_in(index)}"
        )
    return WeightBucket(index, full=tuple(tensors), changed=tuple(deltas))


class _PayloadReader:
    """Hands out regions of a payload: in range, aligned, in order and not overlapping."""

    def __init__(self, payload: torch.Tensor, where: str) -> None:
        self.payload, self.where, self.cursor = payload, where, 0

    def region(self, record: object, name: str, expected: int) -> torch.Tensor:
        at = f"{self.where}: {name}"
        record = _object(record, _REGION_KEYS, f"{at}: a region")
        offset, nbytes = _int(record["offset"], f"{at}: offset"), _int(record["nbytes"], at)
        if nbytes != expected:
            raise WeightLoadError(f"{at}: {nbytes} bytes sent where {expected} are due")
        if offset % ALIGN or offset < self.cursor or offset + nbytes > self.payload.numel():
            raise WeightLoadError(
                f"{at}: bytes [{offset}, {offset + nbytes}) are out of range, unaligned or "
                f"overlap the previous ones (payload {self.payload.numel()} bytes)"
            )
        self.cursor = offset + nbytes
        return self.payload[offset : offset + nbytes]


def _decode_changes(
    item: dict[str, Any], entry: ExportedTensor, reader: _PayloadReader
) -> ChangedElements:
    name = entry.name
    indices = _decode_positions(item, entry, reader)
    values = reader.region(item["values"], name, indices.numel() * entry.dtype.itemsize)
    if item["stepped"] is None:
        return ChangedElements(indices, values.view(entry.dtype))
    at = f"{reader.where}: {name}: steps"
    stepped = _object(item["stepped"], _STEPPED_KEYS, at)
    positions = _decode_positions(stepped, entry, reader)
    width = stepped["width"]
    if width not in (1, 8) or isinstance(width, bool):
        raise WeightLoadError(f"{at}: {width!r} bytes wide (1 or 8 are sent)")
    raw = reader.region(stepped["steps"], name, positions.numel() * width)
    steps = raw.view(torch.int8 if width == 1 else torch.int64).to(torch.int64)
    if bool(torch.isin(positions, indices).any()):
        raise WeightLoadError(f"{at}: a position is both stepped and given a value")
    return ChangedElements(indices, values.view(entry.dtype), positions, steps)


def _decode_positions(
    item: dict[str, Any], entry: ExportedTensor, reader: _PayloadReader
) -> torch.Tensor:
    """The ascending positions a record's ``count``, ``encoding`` and ``positions`` give."""
    name, numel = entry.name, math.prod(entry.shape)
    at = f"{reader.where}: {name}"
    count = _int(item["count"], f"{at}: count")
    if count > numel:
        raise WeightLoadError(f"{at}: {count} changes in {numel} elements")
    encoding = item["encoding"]
    if encoding == "index32" and numel < _INDEX32_LIMIT:
        raw = reader.region(item["positions"], name, 4 * count)
        indices = raw.view(torch.int32).to(torch.int64)
    elif encoding == "bitmask":
        mask = reader.region(item["positions"], name, (numel + 7) // 8)
        shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
        bits = (mask.unsqueeze(1) >> shifts) & 1  # (ceil(numel / 8), 8)
        indices = bits.reshape(-1).nonzero().reshape(-1)
        if indices.numel() != count:
            raise WeightLoadError(
                f"{at}: the bitmask sets {indices.numel()} bits for {count} values"
            )
    else:
        raise WeightLoadError(f"{at}: unknown encoding {encoding!r} for {numel} elements")
    if not _ascending_inside(indices, numel):
        raise WeightLoadError(f"{at}: changed positions are not ascending inside [0, {numel})")
    return indices


def _encode_steps(
    changes: ChangedElements, entry: ExportedTensor, bucket: int, place: Any
) -> dict[str, Any] | None:
    """The changes sent as steps of their bits (positions, then int8 steps where all fit)."""
    if changes.stepped is None or changes.steps is None:
        return None
    if changes.steps.shape != changes.stepped.shape:
        raise WeightExportError(f"bucket {bucket}: {entry.name}: steps and positions differ")
    placeholder = torch.empty(changes.stepped.numel(), dtype=entry.dtype)
    encoding, positions = _encode_positions(
        ChangedElements(changes.stepped, placeholder), entry, bucket
    )
    small = not changes.steps.numel() or int(changes.steps.abs().max()) <= 127
    steps = changes.steps.to(torch.int8 if small else torch.int64)
    record = dict(count=changes.stepped.numel(), encoding=encoding, positions=place(positions))
    return record | dict(width=1 if small else 8, steps=place(_as_bytes(steps)))


def _encode_positions(
    changes: ChangedElements, entry: ExportedTensor, bucket: int
) -> tuple[str, torch.Tensor]:
    """(encoding, its bytes): int32 positions or a bitmask, whichever is smaller."""
    indices, values = changes.indices, changes.values
    numel = math.prod(entry.shape)
    where = f"bucket {bucket}: {entry.name}"
    ok = indices.dtype == torch.int64 and indices.dim() == 1 and values.dtype == entry.dtype
    if not (ok and values.shape == indices.shape and _ascending_inside(indices, numel)):
        raise WeightExportError(
            f"{where}: changes need ascending int64 indices inside [0, {numel}) and as many "
            f"{entry.dtype} values, got {indices.dtype} {list(indices.shape)} and "
            f"{values.dtype} {list(values.shape)}"
        )
    count = indices.numel()
    mask_bytes = (numel + 7) // 8
    if numel < _INDEX32_LIMIT and 4 * count <= mask_bytes:
        return "index32", indices.to(torch.int32).view(torch.uint8)
    # Indices are distinct, so adding each one's bit into its byte sets it.
    bits = torch.ones_like(indices, dtype=torch.int32) << (indices & 7).to(torch.int32)
    mask = torch.zeros(mask_bytes, dtype=torch.int32, device=indices.device)
    return "bitmask", mask.index_add_(0, indices >> 3, bits).to(torch.uint8)


def _ascending_inside(indices: torch.Tensor, numel: int) -> bool:
    """Whether ``indices`` (1-D int64) ascend strictly inside ``[0, numel)``."""
    inside = not indices.numel() or (int(indices[0]) >= 0 and int(indices[-1]) < numel)
    return inside and not bool((indices.diff() <= 0).any())


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a 1-D uint8 view (a copy only where it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _sent_entry(entries: dict[str, ExportedTensor], name: str, bucket: int) -> ExportedTensor:
    entry = entries.get(name)
    if entry is None or entry.bucket != bucket:
        raise WeightExportError(f"bucket {bucket}: {name} is not in this bucket of the manifest")
    return entry


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _wire_name(dtype: torch.dtype) -> str | None:
    name = str(dtype).removeprefix("torch.")
    return name if WIRE_DTYPES.get(name) == dtype else None


def _message(header: bytes, kind: str, keys: set[str]) -> dict[str, Any]:
    """The header's JSON object, checked to be a ``kind`` of this wire version with ``keys``."""
    try:
        raw = json.loads(bytes(header).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise WeightLoadError(f"the {kind} header is not UTF-8 JSON: {error}") from error
    raw = _object(raw, keys, f"the {kind} header")
    if raw["type"] != kind or raw["version"] != WIRE_VERSION:
        raise WeightLoadError(
            f"not a {kind} of wire version {WIRE_VERSION}: type {raw['type']!r}, version "
            f"{raw['version']!r}"
        )
    return raw


def _object(value: object, keys: set[str], where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != keys:
        found = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise WeightLoadError(f"{where}: {found} where an object of {sorted(keys)} is due")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise WeightLoadError(f"{where}: {type(value).__name__} where a list is due")
    return value


def _int(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WeightLoadError(f"{where}: {value!r} is not a non-negative integer")
    return value


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise WeightLoadError(f"{where}: name {value!r} is not a non-empty string")
    return value


def _dtype(value: object, name: str) -> torch.dtype:
    dtype = WIRE_DTYPES.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise WeightLoadError(f"{name}: dtype {value!r} is not one of {sorted(WIRE_DTYPES)}")
    return dtype
