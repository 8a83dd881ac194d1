"""A memory snapshot's header is read from shared memory: input from outside the process.

Whatever JSON a header holds under a valid CRC (a damaged writer, a crafted file), reading it
either gives a header or refuses it as unreadable (``SnapshotRefused``), never another error:
an unexpected exception in one rank's survey would end the restore on every rank instead of
falling back to the next snapshot or the disk checkpoint.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.core import MemorySnapshots
from shardkit.core.snapshots.contents import Layout, leaves_of
from shardkit.core.snapshots.format import (
    JSON_AT,
    REGION_AT,
    Expected,
    Header,
    SnapshotRefusal,
    SnapshotRefused,
    capacity_in,
    data_offset,
    header_region,
    read_header,
    verify_data,
)

RUN = "test-run"


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(4, 3), "loop": {"step": 1, "name": "x"}}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, Any]]:
    """A complete snapshot of step 1 as its slot file holds it, and its header's JSON."""
    directory = tmp_path_factory.mktemp("slots")
    with MemorySnapshots(RUN, directory=directory) as snapshots:
        snapshots.snapshot(1, _state())
        snapshots.wait()
        files = [p.read_bytes() for p in Path(directory).glob("rank00000.slot*.snap")]
    raw = next(f for f in files if b'"step":1,' in f[:8192])
    (length,) = struct.unpack("<Q", raw[REGION_AT + 4 : REGION_AT + 12])
    return raw, json.loads(raw[JSON_AT : JSON_AT + length])


def _with_header(raw: bytes, header_json: bytes) -> torch.Tensor:
    """``raw`` with its header region replaced by ``header_json`` under a valid CRC."""
    data = bytearray(raw)
    region = header_region(header_json, capacity_in(torch.frombuffer(data[:64], dtype=torch.uint8)))
    data[REGION_AT : REGION_AT + len(region)] = region
    return torch.frombuffer(data, dtype=torch.uint8)


def _read(slot: torch.Tensor, layout: Layout | None) -> Header:
    """What a restore's survey and verification read of ``slot``, its data's checksums too."""
    header = read_header(slot, rank=0, expected=Expected(RUN, 1, layout))
    start = data_offset(capacity_in(slot))
    verify_data(header, slot[start : start + header.layout.data_bytes])
    return header


@pytest.mark.parametrize(
    ("checksums", "why"),
    [
        ("zz", "non-hexadecimal"),  # not hex
        ("00" * 8, "not two per block"),  # hex, one number short
        (None, "fromhex"),  # not a string (format 2's list would be one)
    ],
)
def test_a_header_whose_checksums_are_malformed_is_unreadable(
    written: tuple[bytes, dict[str, Any]], checksums: str | None, why: str
) -> None:
    """Anything but whole sums of every block is refused as unreadable, before any data is
    read."""
    raw, header = written
    header = {**header, "checksums": checksums}
    with pytest.raises(SnapshotRefused, match=why) as refused:
        _read(_with_header(raw, json.dumps(header).encode()), None)
    assert refused.value.refusal is SnapshotRefusal.UNREADABLE


@pytest.mark.parametrize(
    ("header_json", "why"),
    [
        (b"[1, 2]", "a JSON array, not an object"),
        (b'"snapshot"', "a JSON string, not an object"),
        (b"null", "a JSON null, not an object"),
        (b'{"format": 3}', "has no 'layout'"),
        (b"[" * 2000 + b"]" * 2000, "nested too deep"),  # json's parser recurses
        (b'{"format": 3, "layout": ' + b"[" * 2000 + b"]" * 2000 + b"}", "nested too deep"),
    ],
)
def test_a_header_that_is_not_a_snapshots_object_is_unreadable(
    written: tuple[bytes, dict[str, Any]], header_json: bytes, why: str
) -> None:
    raw, _ = written
    with pytest.raises(SnapshotRefused, match=why) as refused:
        _read(_with_header(raw, header_json), None)
    assert refused.value.refusal is SnapshotRefusal.UNREADABLE


# Values of every JSON kind, and numbers a header never holds (negative, huge, not whole).
_ODD_VALUES: list[Any] = [None, True, -1, 0, 2**70, 1.5, "x", "", [], [1], [-1], [[]], {}, {"a": 1}]


def _places(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON value, as the keys and indices that lead to it."""
    if path:
        yield path
    if isinstance(value, dict | list):
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            yield from _places(child, (*path, key))


def _harmless(header: dict[str, Any], place: tuple[Any, ...], value: Any) -> bool:
    """Whether a snapshot with ``value`` at ``place`` of its header is one a writer could make
    of this state: a plain value of the loop's set to another JSON scalar, another step, or
    what was there."""
    parent = header
    for key in place[:-1]:
        parent = parent[key]
    if type(parent[place[-1]]) is type(value) and parent[place[-1]] == value:
        return True
    if place[0] == "values" and len(place) == 2:
        return value is None or isinstance(value, bool | int | float | str)
    return place == ("step",) and type(value) is int and 0 <= value < 2**62


def test_any_value_of_a_header_replaced_is_read_or_refused_never_another_error(
    written: tuple[bytes, dict[str, Any]],
) -> None:
    """Each place of the header (run id, world size, rank, step, every field of each layout
    entry, the checksums, the plain values) set to each odd value. Read as an own slot
    (checked against the live state's layout), a header is accepted exactly when a writer
    could have written it for this state; as a replica held for a peer (its layout is
    checked by its owner later), whatever else it holds is refused, never raised."""
    raw, header = written
    layout = Layout.of(leaves_of(_state()))
    wrongly = []
    for place in _places(header):
        for odd in _ODD_VALUES:
            changed = copy.deepcopy(header)
            parent = changed
            for key in place[:-1]:
                parent = parent[key]
            parent[place[-1]] = odd
            slot = _with_header(raw, json.dumps(changed).encode())
            harmless = _harmless(header, place, odd)
            for expected_layout in (None, layout):
                try:
                    read = _read(slot, expected_layout)
                except SnapshotRefused:
                    if harmless:
                        wrongly.append(f"refused {place} = {odd!r}")
                    continue
                if not harmless and expected_layout is not None:
                    wrongly.append(f"accepted {place} = {odd!r}")
                assert read.layout.data_bytes == layout.data_bytes or expected_layout is None
    assert not wrongly, wrongly
