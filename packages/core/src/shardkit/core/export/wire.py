"""Exports on the wire: one JSON header and one raw payload per message, never pickle.

A transport that crosses processes (shared memory, a receiver group) moves a manifest or a
bucket as a UTF-8 JSON header plus one flat run of bytes: the tensors' own bytes, contiguous,
little-endian as torch stores them, each at an offset aligned to :data:`ALIGN` (so the receiver
views them in place, no copy). The other process is not trusted: :func:`decode_manifest` and
:func:`decode_bucket` check every field (types, sizes, offsets, dtype names from an allow-list,
names against the manifest, the total) before any tensor is built, and raise
:class:`~shardkit.core.errors.WeightLoadError` naming what is wrong.

A delta export's changed elements travel as records of the bucket's header
(:mod:`~shardkit.core.export.wire_delta`), and its plain buckets (sent whole) as a full
export's; the field and region checks every decoder shares
are :mod:`~shardkit.core.export.wire_payload`'s.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import ExportedTensor, ExportManifest, WeightBucket
from shardkit.core.export.wire_delta import decode_changes, encode_positions, encode_steps
from shardkit.core.export.wire_payload import (
    ALIGN,
    PayloadReader,
    aligned,
    as_bytes,
    json_int,
    json_list,
    json_name,
    json_object,
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

WIRE_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
        torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool,
    )
}  # fmt: skip
"""The dtypes an export may carry, by their names on the wire."""

_MANIFEST_KEYS = {"type", "version", "export_id", "kind", "bucket_count", "tensors"}
_ENTRY_KEYS = {"name", "shape", "dtype", "bucket"}
_BUCKET_KEYS = {"type", "version", "export_id", "index", "payload_bytes", "full", "changed"}
_FULL_KEYS = {"name", "data"}
_CHANGED_KEYS = {"name", "count", "encoding", "positions", "values", "stepped"}


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
        offset = aligned(cursor)
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
        full.append({"name": name, "data": place(as_bytes(tensor))})
    changed = []
    for name, changes in bucket.changed:
        entry = _sent_entry(entries, name, bucket.index)
        encoding, positions = encode_positions(changes, entry, bucket.index)
        record = dict(name=name, count=changes.indices.numel(), encoding=encoding)
        record |= dict(positions=place(positions), values=place(as_bytes(changes.values)))
        record["stepped"] = encode_steps(changes, entry, bucket.index, place)
        changed.append(record)
    header = dict(type="bucket", version=WIRE_VERSION, export_id=manifest.export_id)
    header |= dict(index=bucket.index, payload_bytes=cursor, full=full, changed=changed)
    return EncodedMessage(json.dumps(header).encode(), cursor, tuple(parts))


def largest_full_payload(manifest: ExportManifest) -> int:
    """The payload bytes of the manifest's largest bucket sent whole (a buffer's size)."""
    sizes = [0] * max(manifest.bucket_count, 1)
    for entry in manifest.tensors:
        nbytes = math.prod(entry.shape) * entry.dtype.itemsize
        sizes[entry.bucket] = aligned(sizes[entry.bucket]) + nbytes
    return max(sizes)


def decode_manifest(header: bytes) -> ExportManifest:
    """A manifest from its header, every field checked.

    Raises:
        WeightLoadError: the header is not a well-formed manifest.
    """
    raw = _message(header, "manifest", _MANIFEST_KEYS)
    export_id = json_int(raw["export_id"], "manifest export_id")
    bucket_count = json_int(raw["bucket_count"], "manifest bucket_count")
    kind = raw["kind"]
    if kind not in ("full", "delta"):
        raise WeightLoadError(f"manifest kind {kind!r} is neither 'full' nor 'delta'")
    tensors: list[ExportedTensor] = []
    seen: set[str] = set()
    for item in json_list(raw["tensors"], "manifest tensors"):
        where = f"manifest entry {len(tensors)}"
        item = json_object(item, _ENTRY_KEYS, where)
        name = json_name(item["name"], where)
        if name in seen:
            raise WeightLoadError(f"manifest names {name!r} twice")
        seen.add(name)
        dims = tuple(
            json_int(d, f"{name}: a dim of the shape") for d in json_list(item["shape"], name)
        )
        bucket = json_int(item["bucket"], f"{name}: bucket")
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
    index = json_int(raw["index"], "bucket index")
    where = f"export {manifest.export_id} bucket {index}"
    if json_int(raw["export_id"], f"{where}: export_id") != manifest.export_id:
        raise WeightLoadError(f"{where}: belongs to export {raw['export_id']}")
    size = json_int(raw["payload_bytes"], f"{where}: payload_bytes")
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != size:
        raise WeightLoadError(
            f"{where}: the header says {size} payload bytes, got {payload.numel()} "
            f"({payload.dtype}, {payload.dim()}-D)"
        )
    full, changed = json_list(raw["full"], where), json_list(raw["changed"], where)
    # A delta export sends a bucket whole where its changes would cost more (a plain bucket).
    if changed and manifest.kind != "delta":
        raise WeightLoadError(f"{where}: a full export's bucket holds changed elements")
    reader = PayloadReader(payload, where)
    entries = manifest.by_name()
    names: list[str] = []

    def entry_of(record: object, keys: set[str]) -> tuple[dict[str, Any], ExportedTensor]:
        item = json_object(record, keys, f"{where}: a tensor record")
        name = json_name(item["name"], where)
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
        deltas.append((entry.name, decode_changes(item, entry, reader)))
    if sorted(names) != sorted(manifest.names_in(index)):
        raise WeightLoadError(
            f"{where}: holds {sorted(names)}, the manifest lists {manifest.names_in(index)}"
        )
    return WeightBucket(index, full=tuple(tensors), changed=tuple(deltas))


def _sent_entry(entries: dict[str, ExportedTensor], name: str, bucket: int) -> ExportedTensor:
    entry = entries.get(name)
    if entry is None or entry.bucket != bucket:
        raise WeightExportError(f"bucket {bucket}: {name} is not in this bucket of the manifest")
    return entry


def _wire_name(dtype: torch.dtype) -> str | None:
    name = str(dtype).removeprefix("torch.")
    return name if WIRE_DTYPES.get(name) == dtype else None


def _message(header: bytes, kind: str, keys: set[str]) -> dict[str, Any]:
    """The header's JSON object, checked to be a ``kind`` of this wire version with ``keys``."""
    try:
        raw = json.loads(bytes(header).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise WeightLoadError(f"the {kind} header is not UTF-8 JSON: {error}") from error
    raw = json_object(raw, keys, f"the {kind} header")
    if raw["type"] != kind or raw["version"] != WIRE_VERSION:
        raise WeightLoadError(
            f"not a {kind} of wire version {WIRE_VERSION}: type {raw['type']!r}, version "
            f"{raw['version']!r}"
        )
    return raw


def _dtype(value: object, name: str) -> torch.dtype:
    dtype = WIRE_DTYPES.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise WeightLoadError(f"{name}: dtype {value!r} is not one of {sorted(WIRE_DTYPES)}")
    return dtype
