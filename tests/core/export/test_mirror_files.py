"""A receiver's mirror in files (``export/mirror_files.py``, ``FullTensorReceiver(mirror_dir=)``).

Deltas into an engine that cannot give its weights back need the last export held whole; in
files, the receiving process holds one bucket at a time. What must hold: every sync hands the
loader exactly ``full_tensor()`` in the export dtype, full and delta alike; the files hold the
last committed export, whole, until the next commit; a file changed from outside is refused by
name; nothing of the model stays in memory between syncs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core.errors import WeightLoadError
from shardkit.core.export.mirror_files import MirrorFiles
from tests.core.export.export_models import full_state, sharded, train_step


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.randn(5, 7).bfloat16(),
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.empty(0, 4, dtype=torch.float16),
        torch.arange(10, dtype=torch.int64)[::2],  # not contiguous
    ],
    ids=["fp32", "bf16", "0-dim", "empty", "strided"],
)
def test_a_tensor_comes_back_as_written_and_a_new_one_each_time(
    tmp_path: Path, tensor: torch.Tensor
) -> None:
    files = MirrorFiles(tmp_path)
    files["w"] = tensor
    first, second = files["w"], files["w"]
    assert torch.equal(first, tensor) and first.dtype == tensor.dtype
    assert first.shape == tensor.shape and files.spec("w") == (tuple(tensor.shape), tensor.dtype)
    if first.numel():
        first.view(-1)[0] = 1 - first.view(-1)[0]  # changing a read changes no file
        assert torch.equal(files["w"], tensor) and torch.equal(second, tensor)


def test_replacing_moving_and_clearing_remove_the_files_they_replace(tmp_path: Path) -> None:
    held, incoming = MirrorFiles(tmp_path, "mirror"), MirrorFiles(tmp_path, "next")
    held["a"], held["b"] = torch.zeros(4), torch.ones(2)
    held["a"] = torch.full((4,), 2.0)  # replaced: one file for "a"
    assert len(list(held.folder.glob("*.bin"))) == 2
    incoming["a"] = torch.full((4,), 3.0)
    incoming["c"] = torch.full((1,), 4.0)
    held.take_from(incoming)
    assert sorted(held) == ["a", "b", "c"] and len(incoming) == 0
    assert not list(incoming.folder.glob("*.bin"))
    assert torch.equal(held["a"], torch.full((4,), 3.0)) and torch.equal(held["b"], torch.ones(2))
    # "a"'s file replaced is kept as the next store's spare: its next "a" is written into it
    # in place (same inode: its pages reused), and a spare of another shape is removed.
    files = sorted(held.folder.glob("*.bin"))
    assert len(files) == 4
    spare = next(f for f in files if f.read_bytes() == torch.full((4,), 2.0).numpy().tobytes())
    inode = spare.stat().st_ino
    incoming["a"] = torch.full((4,), 5.0)
    assert (
        spare.stat().st_ino == inode
        and spare.read_bytes() == torch.full((4,), 5.0).numpy().tobytes()
    )
    assert len(list(held.folder.glob("*.bin"))) == 4 and not list(incoming.folder.glob("*.bin"))
    held.take_from(incoming)
    assert torch.equal(held["a"], torch.full((4,), 5.0))
    incoming["a"] = torch.zeros(3)  # the spare (4 elements) does not fit: removed, a new file
    assert (
        len(list(held.folder.glob("*.bin"))) == 3 and len(list(incoming.folder.glob("*.bin"))) == 1
    )
    incoming.clear()
    del held["b"]
    assert "b" not in held and len(list(held.folder.glob("*.bin"))) == 2
    held.take_from(incoming)
    held["c"] = torch.zeros(1)
    held.clear()
    assert len(held) == 0 and not list(held.folder.glob("*.bin"))
    folder = held.folder
    held.close()
    assert not folder.exists()
    other = MirrorFiles(tmp_path)
    other_folder = other.folder
    del other  # removed with the object too
    assert not other_folder.exists()


def test_a_span_reads_those_elements_alone_and_is_checked(tmp_path: Path) -> None:
    files = MirrorFiles(tmp_path)
    tensor = torch.randn(6, 5).bfloat16()
    files["w"] = tensor
    flat = tensor.reshape(-1)
    for start, count in [(0, 30), (10, 5), (29, 1), (30, 0)]:
        assert torch.equal(files.read_span("w", start, count), flat[start : start + count])
    with pytest.raises(ValueError, match=r"w: elements 28:33 of 30"):
        files.read_span("w", 28, 5)
    (path,) = files.folder.glob("*.bin")
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(WeightLoadError, match="changed outside this process"):
        files.read_span("w", 0, 4)


@pytest.mark.parametrize("change", ["shorter", "longer", "removed"])
def test_a_file_changed_from_outside_is_refused_by_name(tmp_path: Path, change: str) -> None:
    files = MirrorFiles(tmp_path)
    files["model.layers.0.mlp.up_proj.weight"] = torch.randn(8, 8)
    (path,) = files.folder.glob("*.bin")
    data = path.read_bytes()
    if change == "removed":
        path.unlink()
    else:
        path.write_bytes(data[:-4] if change == "shorter" else data + b"\0")
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        files["model.layers.0.mlp.up_proj.weight"]


def _syncs(
    rank: int, world_size: int, folder: str, all_or_nothing: bool, fail_sync: int = -1
) -> dict[str, Any]:
    """Five syncs with ``delta=True``; at ``fail_sync`` the receiver's second load raises."""
    from shardkit.core.errors import WeightExportError
    from shardkit.core.export import ExportOptions, FullTensorReceiver, WeightExporter

    model = sharded("shardkit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    exporter = WeightExporter(model, ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000))
    loaded: dict[str, torch.Tensor] = {}
    calls = [0]

    def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
        calls[0] += 1
        if calls[0] == 2 and failing[0]:
            raise RuntimeError("the engine refused a bucket")
        loaded.update((name, tensor.clone()) for name, tensor in tensors)

    failing = [False]

    receiver = FullTensorReceiver(
        load, keep_mirror=True, all_or_nothing=all_or_nothing, mirror_dir=f"{folder}/{rank}"
    )
    out: dict[str, Any] = {"kinds": [], "wrong_loads": [], "wrong_files": [], "in_memory": []}
    for sync in range(5):
        train_step(model, optimizer, sync, rank)
        loaded.clear()
        calls[0], failing[0] = 0, sync == fail_sync
        try:
            report = exporter.export(receiver if exporter.receiving else None, delta=True)
        except (WeightExportError, WeightLoadError) as error:
            out["kinds"].append(type(error).__name__)
            if exporter.receiving:
                out["after_failure"] = (receiver.version, len(receiver.mirror))
            continue
        oracle = full_state(model, torch.bfloat16)
        out["kinds"].append(report.kind)
        if not exporter.receiving:
            continue
        out["wrong_loads"] += [n for n, t in oracle.items() if not torch.equal(loaded[n], t)]
        held = receiver.mirror
        out["wrong_files"] += [n for n, t in oracle.items() if not torch.equal(held[n], t)]
        out["in_memory"].append(len(receiver._next_mirror) + len(receiver._staged.loads))
        assert isinstance(held, MirrorFiles)
        out["files"] = len(list(held.folder.glob("*.bin")))
        out["tensors"] = len(oracle)
    return out


@pytest.mark.parametrize("all_or_nothing", [False, True], ids=["streamed", "all-or-nothing"])
def test_deltas_rebuilt_from_files_load_exactly_full_tensor(
    tmp_path: Path, all_or_nothing: bool
) -> None:
    results = run_on_ranks(2, _syncs, folder=str(tmp_path), all_or_nothing=all_or_nothing)
    receiving = results[0]
    assert receiving["kinds"] == ["full"] + ["delta"] * 4
    assert receiving["wrong_loads"] == [] and receiving["wrong_files"] == []
    assert receiving["in_memory"] == [0] * 5  # nothing of the model held between syncs
    # One file a tensor; all or nothing, the last version's files stay too, as the spares the
    # next export is written into in place (no more: the older ones gone).
    assert receiving["files"] == receiving["tensors"] * (2 if all_or_nothing else 1)


def test_a_delta_failing_partway_drops_the_files_and_the_next_export_is_full(
    tmp_path: Path,
) -> None:
    # Streamed (vLLM's lean receiver with deltas): the files are rewritten in place as the
    # buckets come, so a failure leaves them mixed; they are dropped, and the exporter's next
    # export is full and makes them whole again.
    results = run_on_ranks(2, _syncs, folder=str(tmp_path), all_or_nothing=False, fail_sync=2)
    receiving = results[0]
    assert receiving["kinds"][:2] == ["full", "delta"]
    assert receiving["kinds"][2] in ("WeightLoadError", "WeightExportError")
    assert results[1]["kinds"][2] in ("WeightLoadError", "WeightExportError")  # every rank
    assert receiving["after_failure"] == (None, 0)
    assert receiving["kinds"][3:] == ["full", "delta"]
    assert receiving["wrong_loads"] == [] and receiving["wrong_files"] == []
    assert receiving["files"] == receiving["tensors"]
