"""Malformed state dict files: refused before anything is written, on every rank, clearly.

Each file here is broken in one way. ``load_full_state_dict`` must raise the same error on
every rank (the coordinator reads the file, the others must not wait for it), name the file
and what is wrong where, and leave every parameter as it was.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, full_params, make_mesh

# A broken file used to hang the other ranks until the process group's timeout: fail fast.
TIMEOUT_S = 60.0


def _header_and_data(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _with_header(header: dict[str, Any] | bytes, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _truncated(path: Path) -> str:
    header, _ = _header_and_data(path)
    path.write_bytes(path.read_bytes()[:-100])
    spans = {k: v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"}
    return max(spans, key=spans.__getitem__)  # the last tensor in the file: cut short


def _offsets_past_the_end(path: Path) -> str:
    header, data = _header_and_data(path)
    begin, _ = header["head.weight"]["data_offsets"]
    header["head.weight"]["data_offsets"] = [begin, len(data) + 4096]
    path.write_bytes(_with_header(header, data))
    return "head.weight"


def _span_not_shape_times_dtype(path: Path) -> str:
    # A tensor of the last group whose span is 4 bytes short of shape x dtype (its shape and
    # dtype match the model): a reader that checks late has written the earlier groups.
    header, data = _header_and_data(path)
    entry = header["blocks.1.mlp.2.weight"]
    entry["data_offsets"][1] -= 4
    path.write_bytes(_with_header(header, data))
    return "blocks.1.mlp.2.weight"


def _empty(path: Path) -> str:
    path.write_bytes(b"")
    return "header"


def _huge_header_length(path: Path) -> str:
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # claims a 1 TiB header
    return "header"


def _header_not_json(path: Path) -> str:
    path.write_bytes(_with_header(b"\xff\xfe not json at all", b""))
    return "header"


def _header_a_list(path: Path) -> str:
    path.write_bytes(_with_header(b"[1, 2, 3]", b""))
    return "header"


def _unknown_dtype(path: Path) -> str:
    header, data = _header_and_data(path)
    header["tok.weight"]["dtype"] = "Q7"
    path.write_bytes(_with_header(header, data))
    return "tok.weight"


def _terabyte_span(path: Path) -> str:
    entry = {"dtype": "F32", "shape": [1 << 18, 1 << 20], "data_offsets": [0, 1 << 40]}
    header = {"tok.weight": entry}
    path.write_bytes(_with_header(header, bytes(64)))
    return "tok.weight"


SAFETENSORS_CASES: dict[str, Callable[[Path], str]] = {
    "truncated": _truncated,
    "offsets_past_the_end": _offsets_past_the_end,
    "span_not_shape_times_dtype": _span_not_shape_times_dtype,
    "empty": _empty,
    "huge_header_length": _huge_header_length,
    "header_not_json": _header_not_json,
    "header_a_list": _header_a_list,
    "unknown_dtype": _unknown_dtype,
    "terabyte_span": _terabyte_span,
}


def _load_body(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from shardkit.core import load_full_state_dict

    model = models.build("gpt")
    apply("shardkit", model, make_mesh(Run(model="gpt"), world_size), Run(model="gpt"))
    before = full_params(model)
    try:
        load_full_state_dict(model, path)
        error, message = "", "no error"
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    after = full_params(model)
    unchanged = all(after[k].equal(v) for k, v in before.items())
    return {"error": error, "message": message, "unchanged": unchanged}


def _assert_refused_everywhere(results: list[dict[str, Any]], path: Path, where: str) -> None:
    from shardkit.core import StateDictFileError

    first = results[0]
    assert first["error"] == StateDictFileError.__name__, first
    assert issubclass(StateDictFileError, ValueError)
    assert str(path) in first["message"] and where in first["message"], first["message"]
    for result in results:
        assert result["message"] == first["message"]  # the same error on every rank
        assert result["unchanged"]


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_broken_safetensors_is_refused_on_every_rank(case: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file(models.build("gpt", seed=3).state_dict(), path)
    where = SAFETENSORS_CASES[case](path)
    results = run_on_ranks(2, _load_body, path=str(path), timeout_s=TIMEOUT_S)
    _assert_refused_everywhere(results, path, where)


class _Payload:
    """Unpickling this would create a directory: a reader that unpickles would show it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.marker,))


def _torch_file(case: str, path: Path) -> str:
    sd = models.build("gpt", seed=3).state_dict()
    if case == "empty":
        path.write_bytes(b"")
    elif case == "pickled_payload":
        torch.save({**sd, "evil": _Payload(str(path.parent / "unpickled"))}, path)
        return "weights_only"
    elif case == "truncated":
        torch.save(sd, path)
        path.write_bytes(path.read_bytes()[:-200])
    elif case == "not_a_dict":
        torch.save(list(sd.values()), path)
        return "list"
    elif case == "garbage":
        path.write_bytes(b"certainly not a checkpoint")
    return "torch.save"


@pytest.mark.parametrize("case", ["empty", "pickled_payload", "truncated", "not_a_dict", "garbage"])
def test_broken_torch_file_is_refused_on_every_rank(case: str, tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    where = _torch_file(case, path)
    results = run_on_ranks(2, _load_body, path=str(path), timeout_s=TIMEOUT_S)
    _assert_refused_everywhere(results, path, where)
    assert not (tmp_path / "unpickled").exists()  # nothing was unpickled


def test_missing_file_is_refused_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "absent.safetensors"
    results = run_on_ranks(2, _load_body, path=str(path), timeout_s=TIMEOUT_S)
    assert [r["error"] for r in results] == ["FileNotFoundError"] * 2, results
    assert all(str(path) in r["message"] and r["unchanged"] for r in results)
