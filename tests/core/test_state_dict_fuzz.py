"""Fuzzing the state dict file reader: a mutated safetensors file is read whole or refused.

Hundreds of files, each a valid one with one mutation (truncated, bytes overwritten in the
header or the data, the header length changed, hostile JSON). Opening each must either give
entries whose every tensor reads complete, or raise ``StateDictFileError`` naming the file:
never another exception, never uninitialised memory, never an allocation the file claims.
One process, no ranks: the reader is what the coordinator runs.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardkit.core import StateDictFileError
from shardkit.core.state_dict.file_readers import open_reader

CASES = 400


def _valid_file() -> bytes:
    from safetensors.torch import save

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=gen),
        "a.bias": torch.randn(7, generator=gen).to(torch.bfloat16),
        "b.steps": torch.arange(3, dtype=torch.int64),
        "c.mask": torch.ones(4, dtype=torch.bool),
    }
    return save(tensors, metadata={"format": "pt"})


def _header_span(raw: bytes) -> tuple[int, int]:
    (length,) = struct.unpack("<Q", raw[:8])
    return 8, 8 + length


def _truncate(raw: bytes, rng: random.Random) -> bytes:
    return raw[: rng.randrange(len(raw))]


def _overwrite_header(raw: bytes, rng: random.Random) -> bytes:
    start, end = _header_span(raw)
    out = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(start, end)] = rng.choice(b'0123456789[]{}":,-. \xff')
    return bytes(out)


def _overwrite_data(raw: bytes, rng: random.Random) -> bytes:
    _, end = _header_span(raw)
    out = bytearray(raw)
    out[rng.randrange(end, len(raw))] ^= 0xFF
    return bytes(out)


def _header_length(raw: bytes, rng: random.Random) -> bytes:
    length = rng.choice([0, 1, 7, len(raw), 1 << 40, (1 << 64) - 1, rng.randrange(1 << 20)])
    return struct.pack("<Q", length) + raw[8:]


def _hostile_json(raw: bytes, rng: random.Random) -> bytes:
    header = rng.choice(
        [
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
            json.dumps({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}).encode(),
            json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}).encode(),
            json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}).encode(),
            json.dumps({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 4]}}).encode(),
            json.dumps({"a": "F32"}).encode(),
            json.dumps({"__metadata__": [1]}).encode(),
        ]
    )
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(16)


MUTATIONS: list[Callable[[bytes, random.Random], bytes]] = [
    _truncate,
    _overwrite_header,
    _overwrite_data,
    _header_length,
    _hostile_json,
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__.strip("_"))
def test_a_mutated_safetensors_file_is_read_whole_or_refused(
    mutation: Callable[[bytes, random.Random], bytes], tmp_path: Path
) -> None:
    valid = _valid_file()
    rng = random.Random(mutation.__name__)
    path = tmp_path / "fuzzed.safetensors"
    refused = 0
    for _ in range(CASES // len(MUTATIONS)):
        path.write_bytes(mutation(valid, rng))
        try:
            reader = open_reader(path)
        except StateDictFileError as error:
            assert str(path) in str(error), error
            refused += 1
            continue
        try:
            for entry in reader.entries:
                tensor = reader.read(entry)
                assert tuple(tensor.shape) == entry.shape and tensor.dtype == entry.dtype
        finally:
            reader.close()
    if mutation is not _overwrite_data:  # flipped data bits are valid files still
        assert refused, "no mutation was refused: the mutations do not reach the checks"
