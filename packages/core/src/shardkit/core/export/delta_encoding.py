"""Changed elements only: a delta export's encoding of one rank's part of one bucket.

Each rank compares its part of a bucket, in the export dtype, with the part it exported last
(kept here: 1/W of the model in that dtype), bit for bit: an element changed when its bits
changed (so -0.0 against 0.0 counts, and a NaN that stays the same NaN does not). It sends
the changes in the smallest of three encodings, chosen per bucket so that the largest rank's
message is smallest (a gather pads every rank's message to the largest):

- ``INDICES``: int32 positions (int64 past 2**31 elements), then the new values;
- ``BITMASK``: one bit per element of the part, then the new values;
- ``STEPS``: the gaps between positions as base-128 varints (one byte for a gap under 128),
  then per change its *step*, the new bits minus the old as an int8; changes whose step does
  not fit (a sign change, a large move) follow as int32 indices into the list of changes and
  their new values. At a small learning rate nearly every change is a step of one unit in the
  last place: about two bytes a change, where the others take six, or 1/16 of the part.

Every rank knows every rank's count and size before the bucket's gather (the small all-gather
at the export's start carries them), so each message is parsed without a header.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "Decoded",
    "Encoding",
    "LocalChanges",
    "choose_encoding",
    "decode",
    "encode",
    "local_changes",
    "message_bytes",
]

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_SHIFTS = torch.arange(8, dtype=torch.uint8)
_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_STEP_LIMIT = 127


class Encoding(enum.IntEnum):
    """How one rank's changes of one bucket travel."""

    INDICES = 0
    BITMASK = 1
    STEPS = 2


@dataclass(frozen=True, slots=True)
class LocalChanges:
    """One rank's changes in its part of one bucket (positions in the flat part)."""

    positions: torch.Tensor
    """(n,) int64, ascending."""
    values: torch.Tensor
    """(n,) the new values."""
    steps: torch.Tensor
    """(n,) int64: new bits minus old bits."""
    length: int
    """Elements of the part."""

    @property
    def count(self) -> int:
        """How many elements changed."""
        return self.positions.numel()

    def steps_bytes(self) -> int:
        """The size of this rank's ``STEPS`` message."""
        gaps = _gaps(self.positions)
        literal = int((self.steps.abs() > _STEP_LIMIT).sum())
        itemsize = self.values.element_size()
        return 4 + int(_varint_sizes(gaps).sum()) + self.count + literal * (4 + itemsize)


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded message: new values at some positions, steps at others (part positions)."""

    positions: torch.Tensor
    values: torch.Tensor
    stepped: torch.Tensor
    steps: torch.Tensor


def local_changes(current: torch.Tensor, previous: torch.Tensor) -> LocalChanges:
    """The changes from the flat ``previous`` to the flat ``current`` (same dtype), bit for bit."""
    width = _WIDTH[current.element_size()]
    now, before = current.view(width), previous.view(width)
    positions = torch.nonzero(now != before).view(-1)
    steps = now[positions].to(torch.int64) - before[positions].to(torch.int64)
    return LocalChanges(positions, current[positions], steps, current.numel())


def _index_dtype(length: int) -> torch.dtype:
    return torch.int32 if length < 2**31 else torch.int64


def _gaps(positions: torch.Tensor) -> torch.Tensor:
    gaps = positions.clone()
    gaps[1:] -= positions[:-1]
    return gaps


def _varint_sizes(values: torch.Tensor) -> torch.Tensor:
    sizes = torch.ones_like(values)
    # Up to 2**63 - 1 (nine groups); 1 << 63 itself would wrap negative in int64.
    for k in range(1, 9):
        sizes += values >= (1 << (7 * k))
    return sizes


def message_bytes(encoding: Encoding, count: int, length: int, itemsize: int, steps: int) -> int:
    """Bytes of one rank's message (``steps``: its ``STEPS`` size, as it posted it)."""
    if encoding is Encoding.INDICES:
        return count * (_index_dtype(length).itemsize + itemsize)
    if encoding is Encoding.BITMASK:
        return -(-length // 8) + count * itemsize
    return steps


def choose_encoding(
    counts: list[int], steps: list[int], length: int, itemsize: int
) -> tuple[Encoding, int]:
    """The encoding whose largest message over the ranks is smallest, and that size.

    Every rank's message is padded to that size: a gather takes equal lengths.
    """

    def largest(e: Encoding) -> int:
        return max(
            message_bytes(e, c, length, itemsize, s) for c, s in zip(counts, steps, strict=True)
        )

    best = min(Encoding, key=lambda e: (largest(e), e.value))
    return best, largest(best)


def encode(changes: LocalChanges, encoding: Encoding, size: int) -> torch.Tensor:
    """One rank's message: uint8, ``size`` bytes (zeros after the message)."""
    device = changes.positions.device
    out = torch.zeros(size, dtype=torch.uint8, device=device)
    if encoding is Encoding.STEPS:
        regions = _steps_regions(changes)
    elif encoding is Encoding.INDICES:
        index = changes.positions.to(_index_dtype(changes.length))
        regions = [index.view(torch.uint8), changes.values.contiguous().view(torch.uint8)]
    else:
        mask = torch.zeros(-(-changes.length // 8) * 8, dtype=torch.uint8, device=device)
        mask[changes.positions] = 1
        head = (mask.view(-1, 8) * _BITS.to(device)).sum(dim=1, dtype=torch.uint8)
        regions = [head, changes.values.contiguous().view(torch.uint8)]
    at = 0
    for region in regions:
        out[at : at + region.numel()] = region
        at += region.numel()
    return out


def _steps_regions(changes: LocalChanges) -> list[torch.Tensor]:
    literal = torch.nonzero(changes.steps.abs() > _STEP_LIMIT).view(-1)
    steps = changes.steps.clone()
    steps[literal] = 0
    count = torch.tensor([literal.numel()], dtype=torch.int32, device=steps.device)
    count = count.view(torch.uint8)
    return [
        count,
        _varints(_gaps(changes.positions)),
        steps.to(torch.int8).view(torch.uint8),
        literal.to(torch.int32).view(torch.uint8),
        changes.values[literal].contiguous().view(torch.uint8),
    ]


def _varints(values: torch.Tensor) -> torch.Tensor:
    """Base-128 varints (low groups first, high bit: more follows), one after another."""
    sizes = _varint_sizes(values)
    starts = torch.cumsum(sizes, 0) - sizes
    out = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=values.device)
    for k in range(int(sizes.max()) if values.numel() else 0):
        has = sizes > k
        group = (values[has] >> (7 * k)) & 0x7F
        more = (sizes[has] > k + 1).to(torch.int64) << 7
        out[starts[has] + k] = (group | more).to(torch.uint8)
    return out


def _read_varints(data: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """``count`` varints from the start of ``data``; and the bytes they took."""
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device), 0
    last = (data < 0x80).nonzero().view(-1)[:count]  # each varint's last byte
    end = int(last[-1]) + 1
    body = data[:end].to(torch.int64)
    ends = torch.zeros(end, dtype=torch.int64, device=data.device)
    ends[last] = 1
    which = torch.cumsum(ends, 0) - ends  # the varint each byte belongs to
    firsts = torch.cat([torch.zeros(1, dtype=torch.int64, device=data.device), last[:-1] + 1])
    shift = 7 * (torch.arange(end, device=data.device) - firsts[which])
    values = torch.zeros(count, dtype=torch.int64, device=data.device)
    values.index_add_(0, which, (body & 0x7F) << shift)
    return values, end


def decode(
    message: torch.Tensor, count: int, length: int, dtype: torch.dtype, encoding: Encoding
) -> Decoded:
    """What :func:`encode` put in ``message``."""
    itemsize = dtype.itemsize
    empty = torch.empty(0, dtype=torch.int64, device=message.device)
    if encoding is Encoding.STEPS:
        literals = int(message[:4].clone().view(torch.int32))
        gaps, used = _read_varints(message[4:], count)
        positions = torch.cumsum(gaps, 0)
        at = 4 + used
        steps = message[at : at + count].clone().view(torch.int8).to(torch.int64)
        at += count
        literal = message[at : at + 4 * literals].clone().view(torch.int32).to(torch.int64)
        at += 4 * literals
        values = message[at : at + literals * itemsize].clone().view(dtype)
        stepped = torch.ones(count, dtype=torch.bool, device=message.device)
        stepped[literal] = False
        return Decoded(positions[literal], values, positions[stepped], steps[stepped])
    if encoding is Encoding.INDICES:
        index_dtype = _index_dtype(length)
        head = count * index_dtype.itemsize
        positions = message[:head].clone().view(index_dtype).to(torch.int64)
    else:
        head = -(-length // 8)
        bits = (message[:head].unsqueeze(1) >> _SHIFTS.to(message.device)) & 1
        positions = torch.nonzero(bits.view(-1)[:length]).view(-1)
        assert positions.numel() == count, "a bitmask's count disagrees with the exchanged one"
    # Cloned: a view of another dtype needs its start aligned to that dtype's size.
    values = message[head : head + count * itemsize].clone().view(dtype)
    return Decoded(positions, values, empty, empty)
