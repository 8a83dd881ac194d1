"""The layout record and the ranks' indexes (``checkpoint/local_plan/layout_record.py``,
``rank_index.py``): what they hold, and hostile input.

A record round-trips every placement the locally planned save handles (``Shard``,
``Replicate``, ``_StridedShard``, FSDP1's ShardedTensor shards) into the same layout (its
digest recomputed), and its size does not grow with the world for meshes of ranks in order.
A truncated, bit-flipped, oversized or inconsistent record, and an index that is damaged or
points past its data file's end, are refused with an error naming the file. Through the
manager at W=2, a record truncated, bit-flipped (with its checksums recomputed too),
oversized, of another world or another shape (every checksum and digest recomputed), an
index item past its file's end and an index of another count are refused on every rank with
the same error naming the problem, every tensor of the model and optimizer unchanged; a save
killed between the data files and ``.metadata`` leaves no checkpoint that the manager or
torch's readers take.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from harness.pool import run_on_ranks
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout, ValueLayout, mesh_key
from shardkit.core.checkpoint.local_plan.layout_record import (
    RECORD,
    encode_record,
    read_record,
    write_record,
)
from shardkit.core.checkpoint.local_plan.rank_index import read_index, write_index
from shardkit.core.checkpoint.local_plan.sharded_tensor_chunks import Shards
from shardkit.core.errors import StateDictFileError
from tests.core.checkpoint.checkpoint_app import build_app, same_state, state_of, train_app

_F32 = TensorProperties(dtype=torch.float32)
_PLAIN = np.zeros((2, 3), dtype=np.int64)  # where the layout's two plain values lie


def _layout(world: int, shards: Shards | None = None) -> SaveLayout:
    """A state of every kind: DTensors on a 1-D and a 2-D mesh, ShardedTensor, plain values."""
    flat = np.arange(world, dtype=np.int64)
    square = flat.reshape(2, world // 2)
    values = [
        ValueLayout("w", "dtensor", (10, 3), _F32, flat, (Shard(0),), mesh_key(flat)),
        ValueLayout(
            "hsdp", "dtensor", (7,), _F32, square, (Replicate(), Shard(0)), mesh_key(square)
        ),
        ValueLayout(
            "tp", "dtensor", (8, 4), _F32, square, (_StridedShard(0, split_factor=2), Shard(0)),
            mesh_key(square),
        ),
        ValueLayout("step", "tensor", (), TensorProperties(dtype=torch.int64)),
        ValueLayout("note", "bytes"),
    ]  # fmt: skip
    if shards is not None:
        rows = int(shards.sizes[:, 0].sum())
        values.append(
            ValueLayout("fsdp1", "sharded", (rows, 2), _F32, flat, (shards,), mesh_key(flat))
        )
    return SaveLayout.from_values(values, world)


def _fsdp1_shards(world: int, rows: int = 5) -> Shards:
    size = -(-rows // world)
    starts = np.minimum(np.arange(world) * size, rows)
    ends = np.minimum(starts + size, rows)
    offsets = np.stack([starts, np.zeros(world, dtype=np.int64)], axis=1)
    return Shards(offsets, np.stack([ends - starts, np.full(world, 2)], axis=1))


def test_a_record_reads_back_into_the_layout_saved(tmp_path: Path) -> None:
    layout = _layout(4, _fsdp1_shards(4))
    plain = np.array([[0, 64, 700], [1, 0, 1200]], dtype=np.int64)
    assert write_record(tmp_path, layout, plain) > 0
    record = read_record(tmp_path)
    read = record.layout
    assert read.digest == layout.digest and record.plain.tolist() == plain.tolist()
    for rank in range(4):
        assert [i.index for i in read.items_of(rank)] == [i.index for i in layout.items_of(rank)]


def test_a_records_size_does_not_grow_with_the_world() -> None:
    sizes = {world: len(encode_record(_layout(world), _PLAIN) or b"") for world in (8, 1024, 8192)}
    assert max(sizes.values()) - min(sizes.values()) <= 16, sizes  # the digits of W only


def test_a_sharded_tensors_chunk_cut_is_a_few_runs_at_any_world(tmp_path: Path) -> None:
    """FSDP1's shards (``torch.chunk``'s cut) were listed, 4 numbers a shard: 70B's record at
    8,192 ranks took each loading rank 160 ms to parse. Written in runs, they are a few
    numbers at any W, and read back into the same shards."""
    sizes = {}
    for world, rows in ((8, 5), (1024, 5), (8192, 5), (8192, 20000), (16384, 128256)):
        layout = _layout(world, _fsdp1_shards(world, rows))
        sizes[world, rows] = write_record(tmp_path, layout, _PLAIN)
        assert read_record(tmp_path).layout.digest == layout.digest
    assert max(sizes.values()) - min(sizes.values()) <= 48, sizes  # digits of W and counts


def test_a_record_of_version_2_with_its_shards_listed_still_reads(tmp_path: Path) -> None:
    """Checkpoints saved before the runs (version 2: every shard's offsets and sizes listed)."""
    layout = _layout(4, _fsdp1_shards(4))
    write_record(tmp_path, layout, _PLAIN)
    body = json.loads((tmp_path / RECORD).read_bytes().partition(b"\n")[2])
    shards = next(v.placements[0] for v in layout.values if v.kind == "sharded")
    body["shards"] = [{"offsets": shards.offsets.tolist(), "sizes": shards.sizes.tolist()}]
    data = json.dumps(body).encode()
    head = f"shardkit-layout 2 {hashlib.sha256(data).hexdigest()}\n".encode()
    (tmp_path / RECORD).write_bytes(head + data)
    read = read_record(tmp_path).layout
    assert read.digest == layout.digest and read.rule == "bytes"


def _rewrite(path: Path, edit: Any) -> None:
    """The record's JSON edited, its checksum made to match (as a forger would)."""
    head, _, data = path.read_bytes().partition(b"\n")
    body = json.loads(data)
    edit(body)
    data = json.dumps(body).encode()
    version = head.split(b" ")[1].decode()  # as written: the shards' form follows from it
    path.write_bytes(
        f"shardkit-layout {version} {hashlib.sha256(data).hexdigest()}\n".encode() + data
    )


def _shape(body: dict[str, Any]) -> None:
    body["values"][0]["shape"] = [11, 3]


def _overlap(body: dict[str, Any]) -> None:
    # Rows start 0, 2, 4, 5: (first 0; step 2 twice, 1 once). Now 0, 0, 2, 3: the second
    # shard over the first one's rows.
    body["shards"][0]["offsets"][0] = [0, 0, 1, 2, 1, 1, 1]


def _runs_too_long(body: dict[str, Any]) -> None:
    body["shards"][0]["sizes"][1] = [2, 0, 9]  # 9 steps for 4 shards


def _rank(body: dict[str, Any]) -> None:
    body["meshes"].append({"shape": [2], "ranks": [0, 9]})
    body["values"][0]["mesh"] = len(body["meshes"]) - 1


def _pickle_ish(body: dict[str, Any]) -> None:
    body["values"][0]["dtype"] = "__class__"


def _plain(body: dict[str, Any]) -> None:
    body["plain"] = body["plain"][:-3]


HOSTILE: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "truncated": ("checksum does not match", lambda p: p.write_bytes(p.read_bytes()[:-7])),
    "bit flipped": (
        "checksum does not match",
        lambda p: p.write_bytes(p.read_bytes()[:-3] + bytes([p.read_bytes()[-3] ^ 4]) + b"}}"),
    ),
    "oversized": ("more than any record", lambda p: p.write_bytes(b"x" * ((256 << 20) + 1))),
    "another layout": ("digest differs", lambda p: _rewrite(p, _shape)),
    "shards overlap": ("overlap or leave holes", lambda p: _rewrite(p, _overlap)),
    "shards' runs past their count": (
        "repeat 9 steps, not 3",
        lambda p: _rewrite(p, _runs_too_long),
    ),
    "rank outside the world": ("lists 2 ranks", lambda p: _rewrite(p, _rank)),
    "not a dtype": ("dtype '__class__'", lambda p: _rewrite(p, _pickle_ish)),
    "a count that disagrees": ("places 1 values", lambda p: _rewrite(p, _plain)),
    "not a record": ("not a layout record", lambda p: p.write_bytes(b"{}\n{}")),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_damaged_record_is_refused_naming_the_file(case: str, tmp_path: Path) -> None:
    write_record(tmp_path, _layout(4, _fsdp1_shards(4)), _PLAIN)
    expected, damage = HOSTILE[case]
    damage(tmp_path / RECORD)
    with pytest.raises(StateDictFileError) as raised:
        read_record(tmp_path)
    assert str(tmp_path / RECORD) in str(raised.value) and expected in str(raised.value)


def test_a_damaged_index_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "__1_0.distcp").write_bytes(b"\0" * 100)
    rows = torch.tensor([[0, 0, 60, 60], [0, 60, 40, 40]])
    write_index(tmp_path, 1, rows)
    assert read_index(tmp_path, 1, 2).tolist() == [[0, 0, 60], [0, 60, 40]]
    for items, expected in ((3, "where 3 items take"),):
        with pytest.raises(StateDictFileError, match=expected):
            read_index(tmp_path, 1, items)
    write_index(tmp_path, 1, torch.tensor([[0, 0, 60, 60], [0, 60, 41, 41]]))
    with pytest.raises(StateDictFileError, match=r"__1\.index.*past the end of __1_0\.distcp"):
        read_index(tmp_path, 1, 2)
    data = bytearray((tmp_path / "__1.index").read_bytes())
    data[-1] ^= 1
    (tmp_path / "__1.index").write_bytes(bytes(data))
    with pytest.raises(StateDictFileError, match="checksum"):
        read_index(tmp_path, 1, 2)


def _saved(rank: int, world_size: int, root: str) -> tuple[Any, Any, Path]:
    """A manager at ``root``, an app trained one step, and its checkpoint (every rank past it)."""
    import torch.distributed as dist

    from shardkit.core import CheckpointManager

    manager = CheckpointManager(root)
    app = build_app(world_size)
    train_app(app, 1, rank, world_size)
    path = manager.save(1, {"app": app})
    dist.barrier()
    return manager, app, path


def _mark(path: Path, *names: str) -> None:
    """The marker's size and checksum of ``names`` made to match them (as a forger would)."""
    marker = json.loads((path / "COMPLETE").read_text())
    for name in names:
        data = (path / name).read_bytes()
        marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "COMPLETE").write_text(json.dumps(marker))


def _reencoded(path: Path, world: int = 0, shrink: str = "") -> None:
    """The record written again, every checksum and digest valid, of another world or with
    ``shrink``'s first dim one smaller: only the checks against the rest of the checkpoint
    can find it."""
    import dataclasses

    record = read_record(path)
    assert not shrink or shrink in {v.fqn for v in record.layout.values}, shrink
    values = [
        dataclasses.replace(v, shape=(v.shape[0] - 1, *v.shape[1:])) if v.fqn == shrink else v
        for v in record.layout.values
    ]
    layout = SaveLayout.from_values(values, world or record.layout.world_size)
    write_record(path, layout, record.plain)
    _mark(path, RECORD)


def _index_edited(path: Path, edit: Callable[[np.ndarray], np.ndarray]) -> None:
    """Rank 1's index rewritten by ``edit``, its own checksum and the marker's made to match."""
    items = ((path / "__1.index").stat().st_size - 48) // 24
    rows = read_index(path, 1, items)
    write_index(path, 1, torch.from_numpy(np.ascontiguousarray(edit(rows))))
    _mark(path, "__1.index")


def _marked_after(path: Path, damage: Callable[[], object]) -> None:
    """The record damaged by ``damage``, then the marker's checksum of it made to match."""
    damage()
    _mark(path, RECORD)


def _flipped(path: Path) -> None:
    data = bytearray((path / RECORD).read_bytes())
    data[len(data) // 2] ^= 0x10
    (path / RECORD).write_bytes(bytes(data))


def _oversized(path: Path) -> None:
    with open(path / RECORD, "r+b") as stream:
        stream.truncate((256 << 20) + 1)
    _mark(path, RECORD)


def _past_end(rows: np.ndarray) -> np.ndarray:
    rows = rows.copy()
    rows[-1, 2] += 1 << 20
    return rows


MANAGER_HOSTILE: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "truncated": (
        "damaged layout record: its checksum does not match",
        lambda p: _marked_after(
            p, lambda: (p / RECORD).write_bytes((p / RECORD).read_bytes()[:-7])
        ),
    ),
    "bit flipped": ("layout.json does not match the checksum recorded at save", _flipped),
    "bit flipped, its checksums recomputed": (
        "digest differs",
        lambda p: _marked_after(p, lambda: _rewrite(p / RECORD, _shape)),
    ),
    "oversized": ("more than any record", _oversized),
    "another world, every checksum recomputed": (
        "layout.json describes a save by 3 ranks, its COMPLETE marker 2",
        lambda p: _reencoded(p, world=3),
    ),
    "a shape shrunk, every checksum recomputed": (
        "Size mismatch between saved",
        lambda p: _reencoded(p, shrink="app.model.tok.weight"),
    ),
    "an item past its file's end": (
        "reaches past the end of __1_0.distcp",
        lambda p: _index_edited(p, _past_end),
    ),
    "a count that disagrees": (
        "__1.index: damaged index",
        lambda p: _index_edited(p, lambda r: r[:-1]),
    ),
}


def _damaged_record_load(rank: int, world_size: int, root: str, case: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardkit.core import CheckpointLoadError

    manager, _, path = _saved(rank, world_size, root)
    if rank == 0:
        MANAGER_HOSTILE[case][1](path)
    dist.barrier()
    fresh = build_app(world_size, seed=7)
    fresh.state_dict()  # torch's get_state_dict makes AdamW's state (zeros): not a load's doing
    before = state_of(fresh)
    try:
        manager.load({"app": fresh})
        error = ""
    except CheckpointLoadError as failure:
        error = str(failure)
    return {"error": error, "unchanged": same_state(state_of(fresh), before)}


@pytest.mark.parametrize("case", sorted(MANAGER_HOSTILE))
def test_a_damaged_record_fails_the_load_on_every_rank_with_nothing_loaded(
    case: str, tmp_path: Path
) -> None:
    """Refused on every rank with the same error naming the problem; every tensor of the model
    and the optimizer as it was."""
    results = run_on_ranks(2, _damaged_record_load, root=str(tmp_path), case=case)
    assert results[0]["error"] == results[1]["error"]
    assert MANAGER_HOSTILE[case][0] in results[0]["error"], results[0]["error"]
    assert "Nothing was loaded" in results[0]["error"], results[0]["error"]
    assert all(result["unchanged"] for result in results)


def _killed_before_metadata(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from shardkit.core import CheckpointManager
    from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
    from shardkit.core.runtime.groups import checkpoint_group

    manager = CheckpointManager(root)
    app = build_app(world_size)
    train_app(app, 1, rank, world_size)
    manager.save(1, {"app": app})
    saved = state_of(app)
    train_app(app, 2, rank, world_size)
    partial = Path(root) / ".step_00000002.partial"

    def killed(*args: Any) -> None:
        # Rank 0 stops after the record, before .metadata (an error rather than a real kill,
        # so that the other rank is told instead of left waiting; the files are the same).
        raise OSError("killed")

    try:  # what the manager's save does up to .metadata: data, indexes, record
        save_planned_locally(
            {"app": app}, partial, LayoutCache(), checkpoint_group(), write_metadata=killed
        )
    except BaseException as error:
        failure = f"{type(error).__name__}: {error}"
    left = sorted(p.name for p in partial.iterdir())
    fresh = build_app(world_size, seed=7)
    loaded = manager.load({"app": fresh})
    try:
        dcp_load({"app": build_app(world_size, seed=7)}, checkpoint_id=partial)
        torch_reads = "loaded"
    except BaseException as error:
        torch_reads = type(error).__name__
    return {
        "failure": failure,
        "left": left,
        "complete": [p.name for p in manager.complete()],
        "loaded": loaded.name if loaded else None,
        "state": same_state(state_of(fresh), saved),
        "torch": torch_reads,
    }


def test_a_save_killed_before_its_metadata_leaves_no_checkpoint_anyone_takes(
    tmp_path: Path,
) -> None:
    results = run_on_ranks(2, _killed_before_metadata, root=str(tmp_path))
    for result in results:
        assert "killed" in result["failure"], result
        assert RECORD in result["left"] and "__0.index" in result["left"], result["left"]
        assert ".metadata" not in result["left"] and "COMPLETE" not in result["left"]
        assert result["complete"] == ["step_00000001"] and result["loaded"] == "step_00000001"
        assert result["state"]
        assert result["torch"] != "loaded"  # torch's reader finds no .metadata


def _killed_before_marker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A save that wrote everything, ``.metadata`` included, and was killed before the
    manager's checksums and marker: what torch's readers and the manager make of it."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from shardkit.core import CheckpointManager, IncompleteCheckpointError
    from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
    from shardkit.core.runtime.groups import checkpoint_group

    manager = CheckpointManager(root)
    app = build_app(world_size)
    train_app(app, 1, rank, world_size)
    manager.save(1, {"app": app})
    train_app(app, 2, rank, world_size)
    at_kill = state_of(app)
    partial = Path(root) / ".step_00000002.partial"
    save_planned_locally({"app": app}, partial, LayoutCache(), checkpoint_group())
    left = sorted(p.name for p in partial.iterdir())
    try:
        manager.load({"app": build_app(world_size, seed=7)}, partial)
        refused = ""
    except IncompleteCheckpointError as error:
        refused = str(error)
    by_torch = build_app(world_size, seed=7)
    dcp_load({"app": by_torch}, checkpoint_id=partial)
    fresh = build_app(world_size, seed=7)
    loaded = manager.load({"app": fresh})
    return {
        "left": left,
        "refused": refused,
        "torch": same_state(state_of(by_torch), at_kill),
        "loaded": loaded.name if loaded else None,
        "complete": [p.name for p in manager.complete()],
    }


def test_a_save_killed_between_its_metadata_and_its_marker_is_torchs_not_the_managers(
    tmp_path: Path,
) -> None:
    """Its data is complete (``.metadata`` comes last): torch's ``dcp.load`` takes it whole;
    the manager counts it incomplete (no marker, and its layout record says it is the
    manager's, not a checkpoint of torch's own) and loads the previous one."""
    for result in run_on_ranks(2, _killed_before_marker, root=str(tmp_path)):
        assert {".metadata", RECORD, "__0.index"} <= set(result["left"]), result["left"]
        assert "COMPLETE" not in result["left"]
        assert "is incomplete" in result["refused"], result["refused"]
        assert result["torch"]
        assert result["complete"] == ["step_00000001"] and result["loaded"] == "step_00000001"


def _without_record(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    manager, app, path = _saved(rank, world_size, root)
    if rank == 0:  # as an older checkpoint of this project: no record, no indexes
        marker = json.loads((path / "COMPLETE").read_text())
        for name in [RECORD, *(f"__{r}.index" for r in range(world_size))]:
            (path / name).unlink()
            del marker["files"][name]
        (path / "COMPLETE").write_text(json.dumps(marker))
    dist.barrier()
    fresh = build_app(world_size, seed=7)
    loaded = manager.load({"app": fresh})
    return {"loaded": loaded is not None, "state": same_state(state_of(fresh), state_of(app))}


def test_a_checkpoint_without_the_record_loads_through_dcps_planning(tmp_path: Path) -> None:
    for result in run_on_ranks(2, _without_record, root=str(tmp_path)):
        assert result["loaded"] and result["state"], result
