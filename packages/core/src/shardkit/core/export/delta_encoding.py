"""Changed elements only: a delta export's encoding of one rank's part of one bucket.

Each rank compares its part of a bucket, in the export dtype, with the part it exported last
(kept: 1/W of the model in that dtype), bit for bit: an element changed when its bits changed
(so -0.0 against 0.0 counts, and a NaN that stays the same NaN does not). It sends the changes
in the smallest of three encodings, chosen per bucket so that the largest rank's message is
smallest (a gather pads every rank's message to the largest), or the part itself:

- ``INDICES``: int32 positions (int64 past 2**31 elements), then the new values;
- ``BITMASK``: one bit per element of the part, then the new values;
- ``STEPS``: the gaps between positions, one byte each (a gap of 0 or over 255 is *escaped*:
  its byte is 0 and the gap follows in a list of its own, as an index), then per change its
  *step*, the new bits minus the old as an int8; changes whose step does not fit (a sign
  change, a large move) follow as int32 indices into the list of changes and their new
  values. At a small learning rate nearly every change is a step of one unit in the last
  place, a few dozen elements from the previous one: about two bytes a change, where the
  others take six, or 1/16 of the part. Every field is a fixed width, so both ends are a few
  whole-tensor operations (no byte groups to walk);
- ``PLAIN``: the part itself, as a full export sends it. A bucket goes plain where no encoding
  is smaller, or where a rank changed more than 1/``DENSE`` of its elements: there decoding
  and placing the changes would cost more time than the bytes they save (a delta is never
  larger than a full export; on one host it is not faster where few elements change:
  docs/guide/export.md, "What is possible on one host").

Finding the changes compares the part eight bytes at a time (a word compare, then the lanes of
the changed words only), so its cost follows the part's size once and the changes' count
after (:func:`changed_lanes`; ``delta_find.py`` does the same span by span as it packs).

Every rank knows every rank's count and size before the bucket's gather (the small all-gather
at the export's start carries them), so each message is parsed without a header.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "DELTA_ENCODINGS",
    "DENSE",
    "STEP_WIDTH",
    "Decoded",
    "Encoding",
    "LocalChanges",
    "as_decoded",
    "changed_lanes",
    "choose_encoding",
    "decode",
    "encode",
    "local_changes",
    "message_bytes",
]

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_SHIFTS = torch.arange(8, dtype=torch.uint8)
WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integers as wide as each element size: a value's bits, read as a number."""
STEP_WIDTH = {1: torch.int32, 2: torch.int32, 4: torch.int64, 8: torch.int64}
"""Integers that hold the difference of two such numbers (for 8 bytes, it wraps as the
receiver's add does)."""
_STEP_LIMIT = 127
_GAP_LIMIT = 255
DENSE = 8
"""Past 1/DENSE of a part's elements changed, a bucket goes plain (measured: there the delta's
encoding, decoding and placing cost more than moving the part; docs/guide/export.md)."""


class Encoding(enum.IntEnum):
    """How one rank's changes of one bucket travel."""

    INDICES = 0
    BITMASK = 1
    STEPS = 2
    PLAIN = 3


DELTA_ENCODINGS = (Encoding.INDICES, Encoding.BITMASK, Encoding.STEPS)
"""The encodings of changes (``PLAIN`` moves the part as a full export does)."""


@dataclass(frozen=True, slots=True)
class LocalChanges:
    """One rank's changes in its part of one bucket (positions in the flat part)."""

    positions: torch.Tensor
    """(n,) ascending: int64, or int32 where the part has fewer than 2**31 elements (a
    part's walk, ``delta_find.py``, holds them so)."""
    values: torch.Tensor
    """(n,) the new values."""
    steps: torch.Tensor
    """(n,) new bits minus old bits: exact (int32 for elements of 1 or 2 bytes, int64 for
    wider ones), or int8 taken modulo the element's width and saturated (a part's walk: a
    step that does not fit a byte reads -128). Either way a step outside [-127, 127] is
    literal: its new value travels."""
    length: int
    """Elements of the part."""

    @property
    def count(self) -> int:
        """How many elements changed."""
        return self.positions.numel()

    def steps_bytes(self) -> int:
        """The size of this rank's ``STEPS`` message."""
        escaped = _escaped_count(self.positions)
        literal = int(torch.count_nonzero(_literal(self.steps)))
        itemsize = self.values.element_size()
        index = _index_dtype(self.length).itemsize
        return 8 + 2 * self.count + escaped * index + literal * (4 + itemsize)


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded message: new values at some positions, steps at others (part positions)."""

    positions: torch.Tensor
    values: torch.Tensor
    stepped: torch.Tensor
    steps: torch.Tensor
    """(m,) int8: a stepped change's step fits a byte (a larger one travels as a value), and
    a byte a change, not eight, is what the gathering rank holds of every rank's steps."""


def changed_lanes(
    now: torch.Tensor, before: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the flat integer views ``now`` and ``before`` differ: positions, new and old bits.

    Compares eight bytes at a time where both views allow it (a length and an offset that are
    multiples of 8 bytes): a word differs where any of its lanes does, and at a few percent of
    elements changed most words are equal, so the lanes are compared for few of them.
    """
    per = 8 // now.element_size()
    try:
        words_now, words_before = now.view(torch.int64), before.view(torch.int64)
    except RuntimeError:  # not viewable as words: element by element
        per = 1
    if per == 1:
        positions = torch.nonzero(now != before).view(-1)
        return positions, now[positions], before[positions]
    words = torch.nonzero(words_now != words_before).view(-1)  # (k,)
    lanes_now = words_now.index_select(0, words).view(now.dtype)  # (k * per,)
    lanes_before = words_before.index_select(0, words).view(now.dtype)
    lanes = torch.nonzero(lanes_now != lanes_before).view(-1)  # ascending
    shift = per.bit_length() - 1  # per is 2, 4 or 8: shifts and masks, not divisions
    positions = (words.index_select(0, lanes >> shift) << shift) | (lanes & (per - 1))
    return positions, lanes_now.index_select(0, lanes), lanes_before.index_select(0, lanes)


def local_changes(current: torch.Tensor, previous: torch.Tensor) -> LocalChanges:
    """The changes from the flat ``previous`` to the flat ``current`` (same dtype), bit for bit."""
    width = WIDTH[current.element_size()]
    positions, new, old = changed_lanes(current.view(width), previous.view(width))
    steps = new.to(STEP_WIDTH[current.element_size()]).sub_(old)
    return LocalChanges(positions, new.view(current.dtype), steps, current.numel())


def _index_dtype(length: int) -> torch.dtype:
    return torch.int32 if length < 2**31 else torch.int64


def _literal(steps: torch.Tensor) -> torch.Tensor:
    """Steps that do not fit an int8 step (two compares: ``abs`` would copy every step)."""
    if steps.dtype == torch.int8:  # saturated (a part's walk): -128 is the only one
        return steps == -_STEP_LIMIT - 1
    return (steps > _STEP_LIMIT) | (steps < -_STEP_LIMIT)


GAP_RUN = 1 << 20
"""Changes whose gaps are worked at once: the gaps of every change would be a copy of the
positions (as wide), held beside them on a rank whose peak is its count and its encoding."""


def _gap_runs(positions: torch.Tensor) -> Iterator[torch.Tensor]:
    """The gaps between ``positions`` (the first from 0), :data:`GAP_RUN` at a time."""
    for lo in range(0, positions.numel(), GAP_RUN):
        hi = min(lo + GAP_RUN, positions.numel())
        gaps = positions[lo:hi].clone()
        gaps[1:] -= positions[lo : hi - 1]
        if lo:
            gaps[0] -= positions[lo - 1]
        yield gaps


def _escaped_count(positions: torch.Tensor) -> int:
    """How many of the gaps between ``positions`` :func:`_escaped` counts, without the gaps.

    Ascending positions differ: only the first gap (from 0) can be 0, and the others escape
    past ``_GAP_LIMIT`` only. Each run of :data:`GAP_RUN` is one subtraction, one compare and
    a count (measured with the literal steps' count, 2.55M changes of a 75M part: 5.1 ms where
    the gaps themselves, a clone, a subtraction in place, two compares and an or, took 14.5).
    """
    if not positions.numel():
        return 0
    first = int(positions[0])
    count = int(first == 0 or first > _GAP_LIMIT)
    last = positions.numel() - 1
    for lo in range(0, last, GAP_RUN):
        hi = min(lo + GAP_RUN, last)
        count += int(
            torch.count_nonzero(positions[lo + 1 : hi + 1] - positions[lo:hi] > _GAP_LIMIT)
        )
    return count


def _escaped(gaps: torch.Tensor) -> torch.Tensor:
    """Gaps that do not fit their byte (0 is the escape itself: only a first position 0)."""
    return (gaps == 0) | (gaps > _GAP_LIMIT)


def message_bytes(encoding: Encoding, count: int, length: int, itemsize: int, steps: int) -> int:
    """Bytes of one rank's message (``steps``: its ``STEPS`` size, as it posted it)."""
    if encoding is Encoding.INDICES:
        return count * (_index_dtype(length).itemsize + itemsize)
    if encoding is Encoding.BITMASK:
        return -(-length // 8) + count * itemsize
    if encoding is Encoding.PLAIN:
        return length * itemsize
    return steps


def choose_encoding(
    counts: list[int], steps: list[int], length: int, itemsize: int
) -> tuple[Encoding, int]:
    """The encoding whose largest message over the ranks is smallest, and that size.

    Every rank's message is padded to that size: a gather takes equal lengths. ``PLAIN``
    where no encoding of changes is smaller than the part, or where a rank changed more than
    1/``DENSE`` of it (``counts`` may then be any number above that).
    """
    plain = length * itemsize
    if max(counts) * DENSE > length:
        return Encoding.PLAIN, plain

    def largest(e: Encoding) -> int:
        return max(
            message_bytes(e, c, length, itemsize, s) for c, s in zip(counts, steps, strict=True)
        )

    best = min(DELTA_ENCODINGS, key=lambda e: (largest(e), e.value))
    size = largest(best)
    return (best, size) if size < plain else (Encoding.PLAIN, plain)


def encode(changes: LocalChanges, encoding: Encoding, size: int) -> torch.Tensor:
    """One rank's message: uint8, ``size`` bytes (zeros after the message)."""
    assert encoding is not Encoding.PLAIN, "a plain bucket moves as a full export's"
    device = changes.positions.device
    out = torch.zeros(size, dtype=torch.uint8, device=device)
    if encoding is Encoding.STEPS:
        regions = _steps_regions(changes)
    elif encoding is Encoding.INDICES:
        index = changes.positions.to(_index_dtype(changes.length))
        regions = [index.view(torch.uint8), changes.values.contiguous().view(torch.uint8)]
    else:
        mask = torch.zeros(-(-changes.length // 8) * 8, dtype=torch.uint8, device=device)
        mask[changes.positions.long()] = 1
        head = (mask.view(-1, 8) * _BITS.to(device)).sum(dim=1, dtype=torch.uint8)
        regions = [head, changes.values.contiguous().view(torch.uint8)]
    at = 0
    for region in regions:
        out[at : at + region.numel()] = region
        at += region.numel()
    return out


def _steps_regions(changes: LocalChanges) -> list[torch.Tensor]:
    literal = torch.nonzero(_literal(changes.steps)).view(-1)
    steps = changes.steps.to(torch.int8)  # wraps where literal: those are read as values
    device = changes.positions.device
    short = torch.empty(changes.count, dtype=torch.uint8, device=device)
    far_runs = [torch.empty(0, dtype=_index_dtype(changes.length), device=device)]
    for lo, gaps in zip(itertools.count(0, GAP_RUN), _gap_runs(changes.positions)):
        escaped = _escaped(gaps)
        far_runs.append(gaps[escaped].to(_index_dtype(changes.length)))
        short[lo : lo + gaps.numel()] = gaps.masked_fill_(escaped, 0)  # ``far`` read already
    far = torch.cat(far_runs)  # few: escaped gaps are rare
    head = torch.tensor([literal.numel(), far.numel()], dtype=torch.int32, device=device)
    return [
        head.view(torch.uint8),
        short,
        steps.view(torch.uint8),
        far.view(torch.uint8),
        literal.to(torch.int32).view(torch.uint8),
        changes.values[literal].contiguous().view(torch.uint8),
    ]


def _region(message: torch.Tensor, at: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    # Cloned: a view of another dtype needs its start aligned to that dtype's size.
    return message[at : at + count * dtype.itemsize].clone().view(dtype)


def decode(
    message: torch.Tensor, count: int, length: int, dtype: torch.dtype, encoding: Encoding
) -> Decoded:
    """What :func:`encode` put in ``message``."""
    empty = torch.empty(0, dtype=torch.int64, device=message.device)
    no_steps = torch.empty(0, dtype=torch.int8, device=message.device)
    if encoding is Encoding.STEPS:
        literals, escapes = (int(n) for n in _region(message, 0, 2, torch.int32))
        gaps = message[8 : 8 + count].to(torch.int64)
        at = 8 + count
        steps = message[at : at + count].view(torch.int8)
        at += count
        index = _index_dtype(length)
        far = _region(message, at, escapes, index).to(torch.int64)
        at += escapes * index.itemsize
        gaps[gaps == 0] = far
        positions = torch.cumsum(gaps, 0)
        literal = _region(message, at, literals, torch.int32).to(torch.int64)
        values = _region(message, at + 4 * literals, literals, dtype)
        return Decoded(positions[literal], values, *_without(positions, steps, literal))
    if encoding is Encoding.INDICES:
        index_dtype = _index_dtype(length)
        head = count * index_dtype.itemsize
        positions = _region(message, 0, count, index_dtype).to(torch.int64)
    else:
        head = -(-length // 8)
        bits = (message[:head].unsqueeze(1) >> _SHIFTS.to(message.device)) & 1
        positions = torch.nonzero(bits.view(-1)[:length]).view(-1)
        assert positions.numel() == count, "a bitmask's count disagrees with the exchanged one"
    return Decoded(positions, _region(message, head, count, dtype), empty, no_steps)


def as_decoded(changes: LocalChanges, encoding: Encoding) -> Decoded:
    """What decoding this rank's own message would give (the gathering rank skips it)."""
    positions = changes.positions.long()  # the cut into tensors shifts them by int64s
    if encoding is not Encoding.STEPS:
        empty = torch.empty(0, dtype=torch.int64, device=positions.device)
        return Decoded(positions, changes.values, empty, empty.to(torch.int8))
    literal = torch.nonzero(_literal(changes.steps)).view(-1)
    # The literal ones wrap in int8, and are dropped: the others fit.
    steps = changes.steps.to(torch.int8)
    return Decoded(
        positions[literal], changes.values[literal], *_without(positions, steps, literal)
    )


def _without(
    positions: torch.Tensor, steps: torch.Tensor, literal: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stepped changes: all but the ``literal`` ones (few, and often none)."""
    if not literal.numel():
        return positions, steps
    keep = torch.ones(positions.numel(), dtype=torch.bool, device=positions.device)
    keep[literal] = False
    kept = torch.nonzero(keep).view(-1)
    return positions.index_select(0, kept), steps.index_select(0, kept)
