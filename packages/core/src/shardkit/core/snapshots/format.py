r"""A memory snapshot's bytes: a header that names what it is, then the data, checksummed.

One snapshot, as it lies in a slot file in the node's shared memory and as it travels to a
peer::

    0   8 bytes   magic, b"SKSNAP1\n"
    8   1 byte    1 once the snapshot is complete; 0 while it is written (torn if it stays so)
    12  4 bytes   CRC-32 of the header's JSON       \
    16  8 bytes   the JSON's length                  } the header region: travels as one message
    24  8 bytes   the JSON's capacity                |
    32  JSON      run id, world size, rank, step,   /
                  the layout, the data's checksums (two sums per 16 KiB block:
                  ``checksum``, as hex), the plain values
    data_offset   the data: each tensor's bytes where the layout puts it (4096-aligned start)

A writer marks the snapshot incomplete before it touches the data, and complete after the
header is written; a writer killed in between leaves a snapshot that reads as torn. Before a
snapshot is trusted, every check below passes, in order; the first that fails names the
refusal (``SnapshotRefusal``). See [Note: memory snapshots].
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.core.snapshots.checksum import (
    BLOCK_BYTES,
    checksum_count,
    first_mismatch,
)
from shardkit.core.snapshots.contents import JSON_LEAVES, JSONValue, Layout, whole_number

__all__ = [
    "Expected",
    "Header",
    "SnapshotError",
    "SnapshotRefusal",
    "SnapshotRefused",
    "capacity_in",
    "layout_json_of",
    "data_offset",
    "header_region",
    "is_blank",
    "parse_region",
    "peek_step",
    "read_header",
    "region_bytes",
    "summary",
    "verify_data",
]

MAGIC = b"SKSNAP1\n"
STATE_AT = 8  # the complete/incomplete byte
REGION_AT = 12  # the header region: CRC, length, capacity, JSON
JSON_AT = 32
_PREFIX = struct.Struct("<IQQ")  # CRC-32, length, capacity (at REGION_AT)
_PAGE = 4096
FORMAT = 3  # 1 had a CRC-32 per tensor; 2 its block sums as a list of JSON numbers
_JSON_KINDS = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


class SnapshotRefusal(enum.Enum):
    """Why a memory snapshot was not trusted."""

    TORN = "torn"
    """Its writer stopped before it was complete (killed mid-copy or mid-transfer)."""
    CHECKSUM = "checksum"
    """Its bytes do not match the checksums recorded when it was written."""
    OTHER_RUN = "another run"
    """It was written by a job with another run id."""
    OTHER_WORLD_SIZE = "another world size"
    """It was written by a job of another world size."""
    OTHER_MODEL = "another model"
    """Its keys, global shapes or dtypes are not the state's (the model fingerprint)."""
    OTHER_LAYOUT = "another layout"
    """Same model and world size, but other local shards (another mesh)."""
    OTHER_RANK = "another rank"
    """It holds another rank's state than its name says."""
    UNREPLAYABLE = "not replayable"
    """A log entry whose replay cannot give its step (``gradient_log``), or did not."""
    UNREADABLE = "unreadable"
    """Not a snapshot of this format: too short, a foreign magic, a header that is not JSON."""


class SnapshotError(RuntimeError):
    """A memory snapshot could not be written, replicated or restored (the message says why)."""


class SnapshotRefused(ValueError):
    """A snapshot failed a check; ``refusal`` says which."""

    def __init__(self, refusal: SnapshotRefusal, detail: str, step: int | None = None) -> None:
        super().__init__(f"{refusal.value}: {detail}")
        self.refusal, self.step = refusal, step  # the step, where the header names one


@dataclass(frozen=True, slots=True)
class Header:
    """What a complete snapshot says of itself."""

    run_id: str
    world_size: int
    rank: int  # whose state it is
    step: int
    layout: Layout
    checksums: bytes  # two 8-byte sums per block of the data (checksum)
    values: dict[str, JSONValue]

    def to_json(self, layout_json: str | None = None) -> bytes:
        """The header as JSON bytes.

        Args:
            layout_json: ``layout_json_of(self.layout)``, made once by a writer that saves the
                same layout every step (hundreds of entries: the header's largest part).
        """
        rest = json.dumps(
            {
                "format": FORMAT,
                "run_id": self.run_id,
                "world_size": self.world_size,
                "rank": self.rank,
                "step": self.step,
                # Hex, not a list of numbers: encoding a GPU's share of hundreds of thousands
                # of them took the background thread 0.1 s, holding the GIL.
                "checksums": self.checksums.hex(),
                "values": self.values,
            },
            separators=(",", ":"),
        )
        layout = layout_json if layout_json is not None else layout_json_of(self.layout)
        return f'{rest[:-1]},"layout":{layout}}}'.encode()

    @staticmethod
    def from_json(raw: bytes) -> Header:
        """The header ``to_json`` wrote.

        Raises ValueError, KeyError or TypeError if it is malformed, RecursionError if its
        JSON is nested too deep for the parser.
        """
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {_JSON_KINDS.get(type(data), 'value')}, not an object")
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this reader knows {FORMAT}")
        layout = Layout.from_json(data["layout"])
        checksums = bytes.fromhex(data["checksums"])
        if len(checksums) != 8 * checksum_count(layout.data_bytes):
            raise ValueError("the data's checksums are not two per block")
        values = data["values"]
        if not isinstance(values, dict) or not all(
            isinstance(value, JSON_LEAVES) for value in values.values()
        ):
            raise ValueError("the plain values must be an object of JSON scalars")
        if set(values) != set(layout.value_keys):
            raise ValueError("the plain values do not match the layout")
        run_id = data["run_id"]
        if not isinstance(run_id, str):
            raise ValueError(f"run_id {run_id!r} is not a string")
        return Header(
            run_id,
            whole_number(data["world_size"], "world_size", least=1),
            whole_number(data["rank"], "rank"),
            whole_number(data["step"], "step"),
            layout,
            checksums,
            values,
        )


def layout_json_of(layout: Layout) -> str:
    """A layout's part of a header, as JSON text."""
    return json.dumps(layout.to_json(), separators=(",", ":"))


def data_offset(capacity: int) -> int:
    """Where the data starts, for a header of ``capacity`` bytes of JSON."""
    return -(-(JSON_AT + capacity) // _PAGE) * _PAGE


def capacity_in(raw: torch.Tensor) -> int:
    """The header capacity recorded in a snapshot whose bytes start ``raw``."""
    _, _, capacity = _PREFIX.unpack(bytes(raw[REGION_AT:JSON_AT].numpy()))
    return int(capacity)


def region_bytes(capacity: int) -> int:
    """The header region's size (CRC, length, capacity, JSON) for ``capacity``."""
    return JSON_AT + capacity - REGION_AT


def header_region(json_bytes: bytes, capacity: int) -> bytes:
    """The header region's bytes for ``json_bytes`` (ValueError if it does not fit)."""
    if len(json_bytes) > capacity:
        raise ValueError(
            f"the snapshot's header takes {len(json_bytes)} bytes, its slot holds {capacity}: "
            "the state's plain values grew since the first snapshot"
        )
    prefix = _PREFIX.pack(zlib.crc32(json_bytes), len(json_bytes), capacity)
    return prefix + json_bytes + bytes(capacity - len(json_bytes))


@dataclass(frozen=True, slots=True)
class Expected:
    """What a snapshot must be to be restored here."""

    run_id: str
    world_size: int
    layout: Layout | None  # None: checked later, by the owner (a replica held for a peer)


def read_header(raw: torch.Tensor, *, rank: int, expected: Expected) -> Header:
    """The header of the snapshot whose bytes start ``raw`` (uint8), checked against ``expected``.

    Everything but the data's checksums (``verify_data``): the format, completeness, the
    header's own checksum, then run id, world size, rank and (if known) model and layout.

    Raises:
        SnapshotRefused: the first check that failed.
    """
    size = raw.numel()
    if size < JSON_AT or bytes(raw[:8].numpy()) != MAGIC:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "not a shardkit memory snapshot")
    if int(raw[STATE_AT]) != 1:
        raise SnapshotRefused(SnapshotRefusal.TORN, "its writer stopped before it was complete")
    _, _, capacity = _PREFIX.unpack(bytes(raw[REGION_AT:JSON_AT].numpy()))
    if data_offset(capacity) > size:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its header overflows the file")
    header = parse_region(raw[REGION_AT : JSON_AT + capacity], rank=rank, expected=expected)
    if data_offset(capacity) + header.layout.data_bytes > size:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its data is cut short")
    return header


def parse_region(region: torch.Tensor, *, rank: int, expected: Expected) -> Header:
    """The header in a header region (uint8: CRC, length, capacity, JSON), checked.

    Raises:
        SnapshotRefused: the header's checksum, its form, or who it belongs to.
    """
    header = _parse(region)
    try:
        _check_identity(header, rank=rank, expected=expected)
    except SnapshotRefused as error:
        raise SnapshotRefused(error.refusal, str(error).split(": ", 1)[1], header.step) from None
    return header


def is_blank(raw: torch.Tensor) -> bool:
    """Whether a slot file was never written (allocated, no snapshot begun in it)."""
    return raw.numel() >= len(MAGIC) and not bool(raw[: len(MAGIC)].any())


def peek_step(raw: torch.Tensor) -> int | None:
    """The step of the complete snapshot whose bytes start ``raw``; None if there is none."""
    if raw.numel() < JSON_AT or bytes(raw[:8].numpy()) != MAGIC or int(raw[STATE_AT]) != 1:
        return None
    _, _, capacity = _PREFIX.unpack(bytes(raw[REGION_AT:JSON_AT].numpy()))
    try:
        return _parse(raw[REGION_AT : JSON_AT + capacity]).step
    except SnapshotRefused:
        return None


def _parse(region: torch.Tensor) -> Header:
    if region.numel() < JSON_AT - REGION_AT:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its header is cut short")
    crc, length, _ = _PREFIX.unpack(bytes(region[: JSON_AT - REGION_AT].numpy()))
    json_bytes = bytes(region[JSON_AT - REGION_AT : JSON_AT - REGION_AT + length].numpy())
    if len(json_bytes) != length or zlib.crc32(json_bytes) != crc:
        raise SnapshotRefused(SnapshotRefusal.CHECKSUM, "the header does not match its checksum")
    try:
        return Header.from_json(json_bytes)
    except KeyError as error:
        detail = f"its header has no {error.args[0]!r}"
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, detail) from None
    except (ValueError, TypeError) as error:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, f"its header: {error}") from None
    except RecursionError:  # arrays nested thousands deep: json's parser recurses
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its header is nested too deep") from None


def _check_identity(header: Header, *, rank: int, expected: Expected) -> None:
    if header.run_id != expected.run_id:
        detail = f"run {header.run_id!r}, this job is run {expected.run_id!r}"
        raise SnapshotRefused(SnapshotRefusal.OTHER_RUN, detail)
    if header.world_size != expected.world_size:
        detail = f"written at world size {header.world_size}, this job has {expected.world_size}"
        raise SnapshotRefused(SnapshotRefusal.OTHER_WORLD_SIZE, detail)
    if header.rank != rank:
        raise SnapshotRefused(SnapshotRefusal.OTHER_RANK, f"rank {header.rank}'s, not {rank}'s")
    if expected.layout is None:
        return
    difference = expected.layout.first_difference(header.layout)
    if difference:
        raise SnapshotRefused(SnapshotRefusal.OTHER_MODEL, difference)
    if header.layout.local_shapes() != expected.layout.local_shapes():
        raise SnapshotRefused(
            SnapshotRefusal.OTHER_LAYOUT, "its local shards have other shapes (another mesh)"
        )
    if header.layout != expected.layout:  # the same writer places the same tensors alike
        raise SnapshotRefused(
            SnapshotRefusal.OTHER_LAYOUT, "its tensors lie elsewhere in its data than here"
        )


def verify_data(header: Header, data: torch.Tensor) -> None:
    """Check the bytes in ``data`` against the header's checksums.

    Raises:
        SnapshotRefused: CHECKSUM, naming the first block that does not match and the tensors
            whose bytes lie in it.
    """
    offset = first_mismatch(header.checksums, data)
    if offset is None:
        return
    end = offset + BLOCK_BYTES
    keys = [e.key for e in header.layout.entries if e.offset < end and e.offset + e.nbytes > offset]
    where = f"{keys[0]}'s" if len(keys) == 1 else f"{keys[0]}'s (or {len(keys) - 1} more's)"
    raise SnapshotRefused(
        SnapshotRefusal.CHECKSUM,
        f"{where if keys else 'padding'} bytes do not match their checksum (bytes {offset} on)",
    )


def summary(header: Header) -> Mapping[str, Any]:
    """The facts of a header that the other ranks need to choose a step (JSON)."""
    return {
        "step": header.step,
        "fingerprint": header.layout.fingerprint(),
        "local_shapes": header.layout.local_shapes(),
    }
