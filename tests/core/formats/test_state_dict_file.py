"""write_state_dict_file: a state dict streamed to one file one tensor at a time, all or nothing."""

from __future__ import annotations

import errno
import gc
import os
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardkit.core import write_state_dict_file
from shardkit.core.formats import file_writers
from tests.core.full_disk import full_disk_open

FORMATS = ["model.safetensors", "model.pt"]


def _values() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(5, 3, generator=gen),
        "blocks.0.scale": torch.randn(7, generator=gen).to(torch.bfloat16),
        "blocks.0.count": torch.arange(4, dtype=torch.int64),
        "head.weight": torch.randn(2, 3, generator=gen).t(),  # not contiguous
    }


def _announced(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in values.items()}


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        loaded: dict[str, torch.Tensor] = load_file(path)
        return loaded
    read: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return read


@pytest.mark.parametrize("name", FORMATS)
def test_writes_every_tensor_in_order(name: str, tmp_path: Path) -> None:
    values = _values()
    path = tmp_path / name
    write_state_dict_file(path, _announced(values), iter(values.items()))
    loaded = _read(path)
    if name.endswith(".pt"):
        assert list(loaded) == list(values)
    assert set(loaded) == set(values)
    for key, value in values.items():
        assert loaded[key].dtype == value.dtype, key
        assert loaded[key].equal(value), key
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize("name", FORMATS)
def test_each_tensor_is_let_go_before_the_next_is_asked_for(name: str, tmp_path: Path) -> None:
    values = _values()
    alive: list[weakref.ref[torch.Tensor]] = []

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for key, value in values.items():
            gc.collect()
            still = [ref for ref in alive if ref() is not None]
            assert not still, f"{len(still)} earlier tensor(s) still held when {key} is asked for"
            fresh = value.clone()
            alive.append(weakref.ref(fresh))
            yield key, fresh
            del fresh  # the producer's own reference; what is left is the writer's

    write_state_dict_file(tmp_path / name, _announced(values), produce())
    assert len(alive) == len(values)


def _bad_streams() -> dict[str, tuple[list[tuple[str, torch.Tensor]], str]]:
    values = _values()
    items = list(values.items())
    wrong_shape = [*items[:2], ("blocks.0.count", torch.arange(5)), *items[3:]]
    wrong_dtype = [*items[:2], ("blocks.0.count", torch.arange(4, dtype=torch.int32)), *items[3:]]
    return {
        "out of order": ([items[1], items[0], *items[2:]], "got 'blocks.0.scale' where"),
        "unannounced": ([*items, ("extra", torch.zeros(1))], "'extra' where no more keys"),
        "shape": (wrong_shape, "blocks.0.count was announced as [4] torch.int64, got [5]"),
        "dtype": (wrong_dtype, "got [4] torch.int32"),
        "ends early": (items[:3], "ended before ['head.weight']"),
    }


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("case", list(_bad_streams()))
def test_a_bad_stream_writes_nothing(name: str, case: str, tmp_path: Path) -> None:
    stream, message = _bad_streams()[case]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        write_state_dict_file(tmp_path / name, _announced(_values()), iter(stream))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", FORMATS)
def test_an_error_of_the_producer_writes_nothing(name: str, tmp_path: Path) -> None:
    values = _values()

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        yield next(iter(values.items()))
        raise OSError("the source went away")

    with pytest.raises(OSError, match="the source went away"):
        write_state_dict_file(tmp_path / name, _announced(values), produce())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("room", [0, 100], ids=["header", "mid-write"])
def test_a_full_disk_leaves_no_partial_file_and_names_the_file(
    room: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The safetensors writer fails at its header (opened outside the cleanup, it once left
    # model.safetensors.partial behind) or in the middle; the write's OSError names no file.
    monkeypatch.setattr(file_writers, "open", full_disk_open(room), raising=False)
    target = tmp_path / "model.safetensors"
    values = _values()
    with pytest.raises(OSError, match=f"No space left on device: '{target}'") as raised:
        write_state_dict_file(target, _announced(values), iter(values.items()))
    assert raised.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_in_torch_format_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(self: object, name: str, tensor: torch.Tensor) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(file_writers.TorchSaveWriter, "write", no_space)
    target = tmp_path / "model.pt"
    values = _values()
    with pytest.raises(OSError, match=f"No space left on device: '{target}'"):
        write_state_dict_file(target, _announced(values), iter(values.items()))
    assert list(tmp_path.iterdir()) == []
