"""``load_torch_file``: the core's reader of untrusted torch.save files, for other packages."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from shardkit.core import StateDictFileError, load_torch_file


class Allowed:
    """A class a caller lets the file name (as FSDP1's ShardedTensor records are let)."""

    def __init__(self) -> None:
        self.value = 3


def test_any_object_of_tensors_and_containers(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    first, second = torch.arange(5.0), torch.ones(2, dtype=torch.bfloat16)
    torch.save([first, {"b": second}], path)
    loaded = load_torch_file(path)
    assert torch.equal(loaded[0], first) and torch.equal(loaded[1]["b"], second)


def test_named_classes_only_when_the_caller_allows_them(tmp_path: Path) -> None:
    path = tmp_path / "object.pt"
    torch.save({"obj": Allowed()}, path)
    with pytest.raises(StateDictFileError, match=f"{path} holds something other than tensors"):
        load_torch_file(path)
    assert load_torch_file(path, safe_globals=[Allowed])["obj"].value == 3


def test_a_legacy_file_claiming_more_than_it_holds_is_refused(tmp_path: Path) -> None:
    # torch < 1.6's format: the storage's element count is in the pickle. One changed count
    # claims 8 GiB; torch.load would allocate it before reading a byte of it.
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.zeros(12345)}, path, _use_new_zipfile_serialization=False)
    raw = path.read_bytes()
    count = b"M" + struct.pack("<H", 12345)  # BININT2: the storage's count, then the shape's
    assert raw.count(count) == 2
    path.write_bytes(raw.replace(count, b"J" + struct.pack("<i", 2**31 - 1), 1))
    with pytest.raises(StateDictFileError, match=f"storages declare {(2**31 - 1) * 4} bytes"):
        load_torch_file(path)  # refused from the pickle's numbers, before torch allocates
    # The same file, undamaged, loads.
    path.write_bytes(raw)
    assert torch.equal(load_torch_file(path)["w"], torch.zeros(12345))
