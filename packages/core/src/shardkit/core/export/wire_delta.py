"""A delta export's changed elements on the wire: positions, values and steps, per tensor.

A tensor's changes travel as a record of the bucket's header and regions of its payload. The
positions go in the smaller of two encodings: int32 flat positions (4 bytes a change; only for
tensors under 2**31 elements) or a bitmask over the whole tensor (one bit an element, bit ``j``
of byte ``i`` for element ``8 * i + j``), then the values. Either decodes to int64 ascending
positions. A bitmask's size comes from the tensor's numel, which the manifest gives. Changes
sent as *steps* of their bits (``ChangedElements.stepped``) add a second set of positions, in
the same encodings, and the steps, int8 where all fit (int64 otherwise). Decoding checks every
count, width and position against the manifest's entry before a tensor is built.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import ChangedElements, ExportedTensor
from shardkit.core.export.wire_payload import PayloadReader, as_bytes, json_int, json_object

__all__ = [
    "ascending_inside",
    "decode_changes",
    "decode_positions",
    "encode_positions",
    "encode_steps",
]

_INDEX32_LIMIT = 2**31
_STEPPED_KEYS = {"count", "encoding", "positions", "width", "steps"}


def decode_changes(
    item: dict[str, Any], entry: ExportedTensor, reader: PayloadReader
) -> ChangedElements:
    """One tensor's changes from its record ``item`` and the payload's regions."""
    name = entry.name
    indices = decode_positions(item, entry, reader)
    values = reader.region(item["values"], name, indices.numel() * entry.dtype.itemsize)
    if item["stepped"] is None:
        return ChangedElements(indices, values.view(entry.dtype))
    at = f"{reader.where}: {name}: steps"
    stepped = json_object(item["stepped"], _STEPPED_KEYS, at)
    positions = decode_positions(stepped, entry, reader)
    width = stepped["width"]
    if width not in (1, 8) or isinstance(width, bool):
        raise WeightLoadError(f"{at}: {width!r} bytes wide (1 or 8 are sent)")
    raw = reader.region(stepped["steps"], name, positions.numel() * width)
    steps = raw.view(torch.int8 if width == 1 else torch.int64).to(torch.int64)
    if bool(torch.isin(positions, indices).any()):
        raise WeightLoadError(f"{at}: a position is both stepped and given a value")
    return ChangedElements(indices, values.view(entry.dtype), positions, steps)


def decode_positions(
    item: dict[str, Any], entry: ExportedTensor, reader: PayloadReader
) -> torch.Tensor:
    """The ascending positions a record's ``count``, ``encoding`` and ``positions`` give."""
    name, numel = entry.name, math.prod(entry.shape)
    at = f"{reader.where}: {name}"
    count = json_int(item["count"], f"{at}: count")
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
    if not ascending_inside(indices, numel):
        raise WeightLoadError(f"{at}: changed positions are not ascending inside [0, {numel})")
    return indices


def encode_steps(
    changes: ChangedElements, entry: ExportedTensor, bucket: int, place: Any
) -> dict[str, Any] | None:
    """The changes sent as steps of their bits (positions, then int8 steps where all fit)."""
    if changes.stepped is None or changes.steps is None:
        return None
    if changes.steps.shape != changes.stepped.shape:
        raise WeightExportError(f"bucket {bucket}: {entry.name}: steps and positions differ")
    placeholder = torch.empty(
        changes.stepped.numel(), dtype=entry.dtype, device=changes.stepped.device
    )
    encoding, positions = encode_positions(
        ChangedElements(changes.stepped, placeholder), entry, bucket
    )
    small = not changes.steps.numel() or int(changes.steps.abs().max()) <= 127
    steps = changes.steps.to(torch.int8 if small else torch.int64)
    record = dict(count=changes.stepped.numel(), encoding=encoding, positions=place(positions))
    return record | dict(width=1 if small else 8, steps=place(as_bytes(steps)))


def encode_positions(
    changes: ChangedElements, entry: ExportedTensor, bucket: int
) -> tuple[str, torch.Tensor]:
    """(encoding, its bytes): int32 positions or a bitmask, whichever is smaller."""
    indices, values = changes.indices, changes.values
    numel = math.prod(entry.shape)
    where = f"bucket {bucket}: {entry.name}"
    ok = indices.dtype == torch.int64 and indices.dim() == 1 and values.dtype == entry.dtype
    if not (ok and values.shape == indices.shape and ascending_inside(indices, numel)):
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


def ascending_inside(indices: torch.Tensor, numel: int) -> bool:
    """Whether ``indices`` (1-D int64) ascend strictly inside ``[0, numel)``."""
    inside = not indices.numel() or (int(indices[0]) >= 0 and int(indices[-1]) < numel)
    return inside and not bool((indices.diff() <= 0).any())
