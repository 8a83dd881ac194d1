"""The export's wire format: round trips, both delta encodings, and malformed input refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import (
    ChangedElements,
    ExportedTensor,
    ExportManifest,
    WeightBucket,
)
from shardkit.core.export.wire import (
    ALIGN,
    decode_bucket,
    decode_manifest,
    encode_bucket,
    encode_manifest,
    largest_full_payload,
)

TENSORS = {
    "a.weight": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    "a.bias": torch.randn(33).float(),
    "a.count": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "b.empty": torch.empty(0, 4, dtype=torch.bfloat16),
    "b.scalar": torch.tensor(2.5),
    "b.big": torch.zeros(100, dtype=torch.bfloat16),
}
BUCKET_OF = {"a.weight": 0, "a.bias": 0, "a.count": 0, "b.empty": 1, "b.scalar": 1, "b.big": 1}


def manifest(kind: str = "full", export_id: int = 3) -> ExportManifest:
    entries = tuple(
        ExportedTensor(name, tuple(t.shape), t.dtype, BUCKET_OF[name])
        for name, t in TENSORS.items()
    )
    return ExportManifest(export_id, kind, entries, 2)  # type: ignore[arg-type]


def full_bucket(index: int) -> WeightBucket:
    return WeightBucket(
        index, full=tuple((n, t) for n, t in TENSORS.items() if BUCKET_OF[n] == index)
    )


def changes(name: str, positions: list[int]) -> ChangedElements:
    values = TENSORS[name].reshape(-1)[positions] + 1
    return ChangedElements(torch.tensor(positions, dtype=torch.int64), values)


DELTA = {
    "a.weight": [0, 3, 34],  # 12 bytes of positions < 5 of bitmask? no: 3*4=12 > 5 -> bitmask
    "a.bias": [7],  # 4 bytes < 5 -> int32
    "a.count": [],
    "b.empty": [],
    "b.scalar": [0],
    "b.big": [1, 50, 99],  # 12 bytes < 13 -> int32
}


def delta_bucket(index: int) -> WeightBucket:
    return WeightBucket(
        index, changed=tuple((n, changes(n, p)) for n, p in DELTA.items() if BUCKET_OF[n] == index)
    )


def round_trip(bucket: WeightBucket, m: ExportManifest) -> tuple[WeightBucket, dict[str, Any]]:
    sent_manifest = decode_manifest(encode_manifest(m).header)
    assert sent_manifest == m
    encoded = encode_bucket(bucket, m)
    payload = encoded.payload()
    assert payload.numel() == encoded.payload_bytes
    return decode_bucket(encoded.header, payload, sent_manifest), json.loads(encoded.header)


@pytest.mark.parametrize("index", [0, 1])
def test_a_full_bucket_round_trips_bit_identically(index: int) -> None:
    got, _ = round_trip(full_bucket(index), manifest())
    sent = full_bucket(index)
    assert [n for n, _ in got.full] == [n for n, _ in sent.full]
    for (_, a), (_, b) in zip(got.full, sent.full, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("index", [0, 1])
def test_a_delta_bucket_round_trips_in_the_smaller_encoding(index: int) -> None:
    got, header = round_trip(delta_bucket(index), manifest("delta"))
    encodings = {r["name"]: r["encoding"] for r in header["changed"]}
    if index == 0:
        assert encodings["a.weight"] == "bitmask" and encodings["a.bias"] == "index32"
    else:
        assert encodings["b.big"] == "index32"
    for (name, a), (_, b) in zip(got.changed, delta_bucket(index).changed, strict=True):
        assert a.indices.dtype == torch.int64 and torch.equal(a.indices, b.indices), name
        assert torch.equal(a.values, b.values), name
    # Applied to the old tensors, the changes give the sender's new ones.
    for name, change in got.changed:
        target = TENSORS[name].clone()
        change.apply_to(target)
        expected = TENSORS[name].clone()
        expected.view(-1)[DELTA[name]] += 1
        assert torch.equal(target, expected)


def test_a_dense_change_goes_as_a_bitmask_and_a_sparse_one_as_positions() -> None:
    weight = torch.zeros(1000, dtype=torch.bfloat16)
    m = ExportManifest(0, "delta", (ExportedTensor("w", (1000,), torch.bfloat16, 0),), 1)
    for positions, encoding, positions_bytes in [
        (list(range(0, 1000, 3)), "bitmask", 125),
        (list(range(0, 1000, 50)), "index32", 80),
    ]:
        change = ChangedElements(torch.tensor(positions), weight[positions] + 1)
        got, header = round_trip(WeightBucket(0, changed=(("w", change),)), m)
        assert header["changed"][0]["encoding"] == encoding
        assert header["changed"][0]["positions"]["nbytes"] == positions_bytes
        assert torch.equal(got.changed[0][1].indices, change.indices)


def test_offsets_are_aligned_and_the_size_bound_covers_full_buckets() -> None:
    m = manifest()
    for index in (0, 1):
        encoded = encode_bucket(full_bucket(index), m)
        assert all(offset % ALIGN == 0 for offset, _ in encoded.parts)
        assert encoded.payload_bytes <= largest_full_payload(m)


def test_the_sender_refuses_a_bucket_that_does_not_match_its_manifest() -> None:
    m = manifest()
    wrong = WeightBucket(0, full=(("a.weight", TENSORS["a.weight"].float()),))
    with pytest.raises(WeightExportError, match=r"a\.weight is \[5, 7\] torch\.float32"):
        encode_bucket(wrong, m)
    with pytest.raises(WeightExportError, match="not in this bucket"):
        encode_bucket(WeightBucket(1, full=(("a.bias", TENSORS["a.bias"]),)), m)
    descending = ChangedElements(torch.tensor([3, 1]), torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(WeightExportError, match="ascending int64 indices inside"):
        encode_bucket(WeightBucket(0, changed=(("a.weight", descending),)), manifest("delta"))


def manifest_header(**changes: Any) -> bytes:
    raw = json.loads(encode_manifest(manifest()).header)
    raw.update(changes)
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"[1, 2]", "list where an object"),
        (b"[" * 100000, "not UTF-8 JSON"),
        (manifest_header(kind="partial"), "neither 'full' nor 'delta'"),
        (manifest_header(extra=1), r"'extra', .* where an object of"),
        (manifest_header(export_id=-1), "not a non-negative integer"),
        (manifest_header(export_id=True), "not a non-negative integer"),
        (manifest_header(bucket_count=1), "bucket 1 of 1"),
        (
            manifest_header(tensors=[{"name": "x", "shape": [2], "dtype": "object", "bucket": 0}]),
            "dtype 'object' is not one of",
        ),
        (
            manifest_header(tensors=[{"name": 7, "shape": [2], "dtype": "int8", "bucket": 0}]),
            "not a non-empty string",
        ),
        (
            manifest_header(tensors=[{"name": "x", "shape": [2.5], "dtype": "int8", "bucket": 0}]),
            "not a non-negative integer",
        ),
        (
            manifest_header(
                tensors=[{"name": "x", "shape": [1], "dtype": "int8", "bucket": 0}] * 2
            ),
            "names 'x' twice",
        ),
    ],
)
def test_a_malformed_manifest_is_refused(header: bytes, match: str) -> None:
    with pytest.raises(WeightLoadError, match=match):
        decode_manifest(header)


def tamper(kind: str, index: int, edit: Any) -> tuple[bytes, torch.Tensor, ExportManifest]:
    m = manifest(kind)
    encoded = encode_bucket(full_bucket(index) if kind == "full" else delta_bucket(index), m)
    raw = json.loads(encoded.header)
    payload = encoded.payload()
    payload = edit(raw, payload) if edit is not None else payload
    return json.dumps(raw).encode(), payload, m


def set_in(path: list[Any], value: Any) -> Any:
    def edit(raw: dict[str, Any], payload: torch.Tensor) -> torch.Tensor:
        node: Any = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return payload

    return edit


def flip_mask_bit(raw: dict[str, Any], payload: torch.Tensor) -> torch.Tensor:
    record = next(r for r in raw["changed"] if r["encoding"] == "bitmask")
    payload[record["positions"]["offset"]] ^= 0b10  # one more changed position than values
    return payload


def reverse_positions(raw: dict[str, Any], payload: torch.Tensor) -> torch.Tensor:
    record = next(r for r in raw["changed"] if r["name"] == "b.big")
    offset = record["positions"]["offset"]
    region = payload[offset : offset + 12].view(torch.int32)
    region.copy_(region.flip(0))
    return payload


def position_past_the_end(raw: dict[str, Any], payload: torch.Tensor) -> torch.Tensor:
    record = next(r for r in raw["changed"] if r["name"] == "b.big")
    offset = record["positions"]["offset"]
    payload[offset + 8 : offset + 12].view(torch.int32).fill_(100)
    return payload


@pytest.mark.parametrize(
    ("kind", "index", "edit", "match"),
    [
        ("full", 0, lambda raw, p: p[:-1], "payload bytes"),
        ("full", 0, set_in(["payload_bytes"], 10**12), "payload bytes"),
        ("full", 0, set_in(["full", 1, "data", "offset"], 10**9), "out of range"),
        ("full", 0, set_in(["full", 1, "data", "offset"], 0), "overlap"),
        ("full", 0, set_in(["full", 0, "data", "offset"], 3), "unaligned"),
        ("full", 0, set_in(["full", 0, "data", "nbytes"], 4), "bytes sent where 70 are due"),
        ("full", 0, set_in(["full", 0, "name"], "b.big"), "not in this bucket"),
        ("full", 0, set_in(["full"], []), "the manifest lists"),
        ("full", 0, set_in(["export_id"], 4), "belongs to export 4"),
        ("full", 0, set_in(["index"], "0"), "not a non-negative integer"),
        ("delta", 0, set_in(["changed", 0, "encoding"], "zstd"), "unknown encoding"),
        ("delta", 0, set_in(["changed", 0, "count"], 10**6), "changes in 35 elements"),
        ("delta", 0, flip_mask_bit, "bitmask sets 4 bits for 3 values"),
        ("delta", 1, reverse_positions, "not ascending"),
        ("delta", 1, position_past_the_end, "not ascending inside"),
        (
            "delta",
            1,
            set_in(["full"], [{"name": "b.big", "data": {"offset": 0, "nbytes": 200}}]),
            "out of range|sent twice",
        ),
        ("full", 1, set_in(["changed"], [{"name": "b.big"}]), "holds changed elements"),
    ],
)
def test_a_malformed_bucket_is_refused(kind: str, index: int, edit: Any, match: str) -> None:
    header, payload, m = tamper(kind, index, edit)
    with pytest.raises(WeightLoadError, match=match):
        decode_bucket(header, payload, m)


def test_an_untampered_bucket_passes_the_same_checks() -> None:
    for kind in ("full", "delta"):
        for index in (0, 1):
            header, payload, m = tamper(kind, index, None)
            assert decode_bucket(header, payload, m).index == index


def test_changes_sent_as_steps_of_their_bits_round_trip() -> None:
    """Steps (new bits minus old bits) travel beside new values, int8 where all fit, int64
    where one does not; applied to the old tensor they give the new one bit for bit."""
    old = TENSORS["b.big"].clone()
    old[:10] = torch.linspace(0.5, 1.5, 10).to(torch.bfloat16)
    new = old.clone()
    bits = new.view(torch.int16)
    bits[[2, 3, 8]] += torch.tensor([1, -1, 2], dtype=torch.int16)
    new[60] = 7.0  # a value, not a step
    for steps, width in (([1, -1, 2], 1), ([1, -1, 300], 8)):
        target = new.clone()
        target.view(torch.int16)[8] = old.view(torch.int16)[8] + steps[2]
        change = ChangedElements(
            torch.tensor([60]), target[[60]], torch.tensor([2, 3, 8]), torch.tensor(steps)
        )
        bucket = WeightBucket(1, changed=(("b.big", change),))
        m = ExportManifest(3, "delta", (ExportedTensor("b.big", (100,), torch.bfloat16, 1),), 2)
        got, header = round_trip(bucket, m)
        assert header["changed"][0]["stepped"]["width"] == width
        applied = old.clone()
        got.changed[0][1].apply_to(applied)
        assert torch.equal(applied.view(torch.int16), target.view(torch.int16))
