"""vLLM's worker committing an export from files (``export/vllm_files.py``), on a stand-in worker.

What must hold: the worker loads each file's tensor as the load asks for it, holding none of
those it handed on; a load that raises is followed by the last export's files, loaded the same
way (or, where none were given, the copy taken in memory first), so the model is what it was
and serves the version it served; if that raises too the worker says it holds a mix; and a list
of files that does not check out (a path that is not a receiver's file, a size that is not the
shape's, a dtype it does not know, a name twice) is refused, naming the tensor, before anything
is loaded. vLLM itself: ``tests/vllm/test_vllm_receiver.py``.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from shardkit.core.export.mirror_files import MirrorFiles
from shardkit.core.export.vllm_files import commit_files_on_worker, started_from
from shardkit.core.export.vllm_versions import serving_version

SHAPES = {"embed": (6, 4), "layer.weight": (4, 4), "layer.bias": (4,)}


class _Model(torch.nn.Module):
    """Takes tensors by name, as vLLM's ``load_weights`` does; refuses ``failing`` ones."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(
                name.replace(".", "_"), torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
            )
        self.failing: set[str] = set()
        self.fail_once = True
        """A refused name is taken once it went in (a bad tensor of one export), not again."""
        self.alive_before: list[int] = []
        """Per tensor taken: how many of the tensors taken before it are still alive."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        taken: list[weakref.ref[torch.Tensor]] = []
        for name, tensor in weights:
            self.alive_before.append(sum(ref() is not None for ref in taken))
            if name in self.failing:
                if self.fail_once:
                    self.failing.discard(name)
                raise RuntimeError(f"the loader refused {name}")
            getattr(self, name.replace(".", "_")).data.copy_(tensor)
            taken.append(weakref.ref(tensor))

    def values(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name.replace(".", "_")).detach().clone() for name in SHAPES}


def _worker(model: _Model, started_from: Path | None = None) -> Any:
    config = SimpleNamespace(model=str(started_from) if started_from else "org/a-hub-name")
    return SimpleNamespace(
        model_runner=SimpleNamespace(get_model=lambda: model, model_config=config)
    )


def _version(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator).bfloat16() for name, shape in SHAPES.items()
    }


def _files(store: MirrorFiles, tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
    for name, tensor in tensors.items():
        store[name] = tensor
    return [[name, *store.file_of(name)] for name in tensors]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@dataclass
class _Served:
    """A stand-in worker serving export 1 from its files, export 2 written beside them."""

    model: _Model
    worker: Any
    first: dict[str, torch.Tensor]
    second: dict[str, torch.Tensor]
    stores: tuple[MirrorFiles, MirrorFiles]  # held: their folders go with them
    back: list[list[Any]]
    load: list[list[Any]]


def _export_1_served(tmp_path: Path) -> _Served:
    model, first, second = _Model(), _version(1), _version(2)
    worker = _worker(model)
    mirror, written = MirrorFiles(tmp_path, "mirror"), MirrorFiles(tmp_path, "next")
    back = _files(mirror, first)
    commit_files_on_worker(worker, 1, "load_weights", back, [])
    return _Served(model, worker, first, second, (mirror, written), back, _files(written, second))


def test_an_export_is_loaded_from_its_files_one_tensor_at_a_time(tmp_path: Path) -> None:
    model, first = _Model(), _version(1)
    worker = _worker(model)
    written = MirrorFiles(tmp_path, "next")  # held: its folder goes with it
    load = _files(written, first)

    assert commit_files_on_worker(worker, 1, "load_weights", load, []) == 1

    assert _equal(model.values(), first) and serving_version(worker) == 1
    assert model.alive_before == [0, 0, 0]  # none of the tensors handed on is held


def test_a_load_that_raises_puts_the_last_export_back_from_its_files(tmp_path: Path) -> None:
    served = _export_1_served(tmp_path)
    model, worker, first, second = served.model, served.worker, served.first, served.second
    back, load = served.back, served.load
    model.failing = {"layer.bias"}  # after the two others went in

    with pytest.raises(RuntimeError) as caught:
        commit_files_on_worker(worker, 2, "load_weights", load, back)

    message = str(caught.value)
    assert "export 2 raised: the loader refused layer.bias" in message
    assert "loaded again from their files" in message and "serves export 1" in message
    assert _equal(model.values(), first) and serving_version(worker) == 1
    # With no files to put back from (the first export into an engine), a copy in memory.
    model.failing = {"layer.bias"}
    with pytest.raises(RuntimeError, match=r"from a copy in memory.*serves export 1"):
        commit_files_on_worker(worker, 2, "load_weights", load, [])
    assert _equal(model.values(), first) and serving_version(worker) == 1
    commit_files_on_worker(worker, 2, "load_weights", load, back)
    assert _equal(model.values(), second) and serving_version(worker) == 2


def test_a_put_back_that_raises_too_is_said_and_nothing_claims_a_version(tmp_path: Path) -> None:
    served = _export_1_served(tmp_path)
    served.model.failing, served.model.fail_once = {"layer.weight"}, False

    with pytest.raises(RuntimeError, match=r"Putting export 1 back raised too.*holds a mix"):
        commit_files_on_worker(served.worker, 2, "load_weights", served.load, served.back)
    assert serving_version(served.worker) is None


def _hostile(case: str, entry: list[Any], tmp_path: Path) -> list[Any]:
    name, path, shape, dtype = entry
    if case == "relative":
        return [name, os.path.relpath(path), shape, dtype]
    if case == "not-a-mirror-folder":
        other = tmp_path / "elsewhere"
        other.mkdir()
        (other / "0.bin").write_bytes(Path(path).read_bytes())
        return [name, str(other / "0.bin"), shape, dtype]
    if case == "not-a-mirror-file":
        renamed = Path(path).with_name("weights.safetensors")
        renamed.write_bytes(Path(path).read_bytes())
        return [name, str(renamed), shape, dtype]
    if case == "symlink":
        link = Path(path).with_name("999.bin")
        link.symlink_to(path)
        return [name, str(link), shape, dtype]
    if case == "missing":
        return [name, str(Path(path).with_name("998.bin")), shape, dtype]
    if case == "other-size":
        return [name, path, [shape[0] + 1, *shape[1:]], dtype]
    if case == "unknown-dtype":
        return [name, path, shape, "complex128"]
    if case == "negative-size":
        return [name, path, [-1, *shape[1:]], dtype]
    if case == "bool-size":
        return [name, path, [True] * len(shape), dtype]
    if case == "no-list":
        return [name, path]
    raise AssertionError(case)


CASES = [
    "relative",
    "not-a-mirror-folder",
    "not-a-mirror-file",
    "symlink",
    "missing",
    "other-size",
    "unknown-dtype",
    "negative-size",
    "bool-size",
    "no-list",
]


@pytest.mark.parametrize("case", CASES)
def test_files_that_do_not_check_out_are_refused_by_name_and_nothing_is_loaded(
    tmp_path: Path, case: str
) -> None:
    served = _export_1_served(tmp_path)
    model, worker, first = served.model, served.worker, served.first
    back, load = served.back, served.load
    bad = next(i for i, entry in enumerate(load) if entry[0] == "layer.weight")
    load[bad] = _hostile(case, load[bad], tmp_path)

    with pytest.raises(ValueError) as caught:
        commit_files_on_worker(worker, 2, "load_weights", load, back)

    message = str(caught.value)
    assert "nothing was loaded" in message
    assert "layer.weight" in message or case == "no-list"
    assert _equal(model.values(), first) and serving_version(worker) == 1
    assert model.alive_before == [0, 0, 0]  # only the first export's loads ran


def test_lists_naming_a_tensor_twice_or_other_tensors_are_refused(tmp_path: Path) -> None:
    served = _export_1_served(tmp_path)
    model, worker, first = served.model, served.worker, served.first
    back, load = served.back, served.load

    with pytest.raises(ValueError, match="embed: named twice"):
        commit_files_on_worker(worker, 2, "load_weights", [*load, load[0]], back)
    with pytest.raises(ValueError, match="name other tensors"):
        commit_files_on_worker(worker, 2, "load_weights", load, back[:2])
    assert _equal(model.values(), first) and serving_version(worker) == 1


def test_the_first_export_puts_back_the_checkpoint_the_engine_started_from(
    tmp_path: Path,
) -> None:
    # Nothing is in files before the first export: where the engine started from a local
    # folder of safetensors files (here fp32, as a checkpoint may be), those are put back.
    start, first = _version(0), _version(1)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    save_file({n: t.float() for n, t in start.items()}, str(folder / "model.safetensors"))
    model = _Model()
    model.load_weights(start.items())
    worker = _worker(model, folder)
    written = MirrorFiles(tmp_path, "next")
    load = _files(written, first)
    model.failing = {"layer.bias"}

    with pytest.raises(RuntimeError, match=r"from the checkpoint it started from.*serves export"):
        commit_files_on_worker(worker, 1, "load_weights", load, [])

    assert _equal(model.values(), start) and serving_version(worker) is None
    assert started_from(worker, set(SHAPES)) is not None
    assert started_from(worker, {*SHAPES, "not.in.it"}) is None


@pytest.mark.parametrize("damage", ["offsets", "header-length", "dtype"])
def test_a_checkpoint_whose_header_does_not_check_out_is_not_read(
    tmp_path: Path, damage: str
) -> None:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    file = folder / "model.safetensors"
    save_file(_version(0), str(file))
    data = bytearray(file.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    if damage == "offsets":
        header["embed"]["data_offsets"][1] += 10**6
    elif damage == "dtype":
        header["embed"]["dtype"] = "C64"
    text = json.dumps(header).encode().ljust(length)
    if damage == "header-length":
        data[:8] = (len(data) * 2).to_bytes(8, "little")
    elif len(text) == length:
        data[8 : 8 + length] = text
    else:
        data = bytearray(len(text).to_bytes(8, "little")) + text + data[8 + length :]
    file.write_bytes(bytes(data))
    worker = _worker(_Model(), folder)

    assert started_from(worker, set(SHAPES)) is None  # the copy in memory is put back instead
