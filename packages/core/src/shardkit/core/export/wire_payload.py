"""The parts of a wire message a receiver reads before trusting them: JSON fields and regions.

A header comes from another process (:mod:`~shardkit.core.export.wire`): each field is checked
for its type and range before it is used, and each region of the payload a header points to is
checked to lie inside the payload, aligned to :data:`ALIGN`, after the previous one and not
overlapping it (:class:`PayloadReader`). Every failure is a
:class:`~shardkit.core.errors.WeightLoadError` naming where it is.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit.core.errors import WeightLoadError

__all__ = [
    "ALIGN",
    "PayloadReader",
    "aligned",
    "as_bytes",
    "json_int",
    "json_list",
    "json_name",
    "json_object",
]

ALIGN = 64
"""Every region of a payload starts at a multiple of this (any dtype views it in place)."""

_REGION_KEYS = {"offset", "nbytes"}


class PayloadReader:
    """Hands out regions of a payload: in range, aligned, in order and not overlapping."""

    def __init__(self, payload: torch.Tensor, where: str) -> None:
        self.payload, self.where, self.cursor = payload, where, 0

    def region(self, record: object, name: str, expected: int) -> torch.Tensor:
        """The region ``record`` points to, of ``expected`` bytes, for tensor ``name``."""
        at = f"{self.where}: {name}"
        record = json_object(record, _REGION_KEYS, f"{at}: a region")
        offset, nbytes = json_int(record["offset"], f"{at}: offset"), json_int(record["nbytes"], at)
        if nbytes != expected:
            raise WeightLoadError(f"{at}: {nbytes} bytes sent where {expected} are due")
        if offset % ALIGN or offset < self.cursor or offset + nbytes > self.payload.numel():
            raise WeightLoadError(
                f"{at}: bytes [{offset}, {offset + nbytes}) are out of range, unaligned or "
                f"overlap the previous ones (payload {self.payload.numel()} bytes)"
            )
        self.cursor = offset + nbytes
        return self.payload[offset : offset + nbytes]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a 1-D uint8 view (a copy only where it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def aligned(offset: int) -> int:
    """``offset`` rounded up to :data:`ALIGN`."""
    return -(-offset // ALIGN) * ALIGN


def json_object(value: object, keys: set[str], where: str) -> dict[str, Any]:
    """``value``, checked to be an object with exactly ``keys``."""
    if not isinstance(value, dict) or set(value) != keys:
        found = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise WeightLoadError(f"{where}: {found} where an object of {sorted(keys)} is due")
    return value


def json_list(value: object, where: str) -> list[Any]:
    """``value``, checked to be a list."""
    if not isinstance(value, list):
        raise WeightLoadError(f"{where}: {type(value).__name__} where a list is due")
    return value


def json_int(value: object, where: str) -> int:
    """``value``, checked to be a non-negative integer (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WeightLoadError(f"{where}: {value!r} is not a non-negative integer")
    return value


def json_name(value: object, where: str) -> str:
    """``value``, checked to be a non-empty string."""
    if not isinstance(value, str) or not value:
        raise WeightLoadError(f"{where}: name {value!r} is not a non-empty string")
    return value
