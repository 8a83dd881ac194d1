"""Saves planned by each rank alone (``checkpoint/local_plan/save.py``) against torch's DCP save.

Each case saves the same state twice on gloo ranks, once through ``dcp.save`` (torch's
``DefaultSavePlanner``) and once planned locally, then compares, in the test's process:
the ``.metadata`` (every tensor's properties, size and chunks, the flattening's mappings,
which (key, offset) entries have storage) and every saved tensor, read back whole with DCP's
own ``dcp_to_torch_save``. The layout's arithmetic is also checked against torch's own
per-coordinate function on meshes with uneven and empty shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from harness.pool import run_on_ranks
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout, ValueLayout
from tests.core.checkpoint.dcp_checks import (
    CollectivesBeforeWrite,
    assert_same,
    metadata_content,
    read_metadata,
)


def _model(rows: int, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, rows), torch.nn.ReLU(), torch.nn.Linear(rows, 3), torch.nn.LayerNorm(3)
    )


def _trained_state(rank: int, mesh_shape: list[int], rows: int) -> dict[str, Any]:
    """shardkit's ``fully_shard`` model (HSDP on a 2-D mesh) and AdamW after one step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    model = _model(rows)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _save_both(rank: int, world_size: int, root: str, mesh_shape: list[int], rows: int) -> Any:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
    from shardkit.core.runtime.groups import checkpoint_group

    state = {**_trained_state(rank, mesh_shape, rows), "step": 3, "note": "w"}
    group = checkpoint_group()
    with CollectivesBeforeWrite() as torchs:
        dcp_save(state, checkpoint_id=f"{root}/torch")
    cache = LayoutCache()
    with CollectivesBeforeWrite() as ours:
        times = save_planned_locally(state, Path(f"{root}/local"), cache, group)
    first_layout = cache.layout
    again = save_planned_locally(state, Path(f"{root}/again"), cache, group)
    return {
        "collectives_before_write": (ours.before_write, torchs.before_write),
        "layout_reused": cache.layout is first_layout,
        "plan_s": [times.plan, again.plan],
    }


CASES = {
    "fsdp W=2": (2, [2], 16),
    "fsdp W=2, uneven": (2, [2], 5),
    "fsdp W=4, empty shards": (4, [4], 3),
    "hsdp 2x2": (4, [2, 2], 6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_local_plan_saves_what_dcp_saves(case: str, tmp_path: Path) -> None:
    world, mesh_shape, rows = CASES[case]
    results = run_on_ranks(world, _save_both, root=str(tmp_path), mesh_shape=mesh_shape, rows=rows)
    # None before the files are written; torch's save (the same counter) plans with some.
    assert all(r["collectives_before_write"][0] == 0 for r in results), results
    assert all(r["collectives_before_write"][1] > 0 for r in results), results
    assert all(r["layout_reused"] for r in results)  # the second save planned nothing anew
    theirs, ours = read_metadata(tmp_path / "torch"), read_metadata(tmp_path / "local")
    assert metadata_content(ours) == metadata_content(theirs)
    assert metadata_content(read_metadata(tmp_path / "again")) == metadata_content(theirs)
    for name in ("torch", "local"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
    full_theirs = torch.load(tmp_path / "torch.pt", weights_only=True)
    full_ours = torch.load(tmp_path / "local.pt", weights_only=True)
    assert_same(full_ours, full_theirs, "")


MESHES = [
    ((7, 3), (4,), (Shard(0),)),
    ((3, 5), (8,), (Shard(0),)),
    ((5, 4), (2, 2), (Replicate(), Shard(0))),
    ((5, 4), (2, 3), (Shard(0), Shard(0))),
    ((9, 6), (2, 4), (Shard(1), Shard(0))),
    ((2, 3), (2, 2, 2), (Replicate(), Shard(0), Shard(1))),
    ((0, 4), (3,), (Shard(0),)),
    ((8, 4), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP x TP on one dim
]


def test_distinct_chunks_are_numpys_unique_rows() -> None:
    """The chunks grouped by one number a row (``_distinct_rows``), as ``np.unique`` groups
    them row by row: the same rows, first places, groups and counts, in the same order."""
    import numpy as np

    from shardkit.core.checkpoint.local_plan.chunk_geometry import _distinct_rows

    rng = np.random.default_rng(0)
    for shape in ((7, 5), (3,), (0, 4), (4, 0, 6), (), (9, 2), (2**40, 2**30)):
        high = np.array(shape, dtype=np.int64) + 1
        for beyond in (0, 2):  # within the shape (a chunk's offsets), and past it
            offsets = rng.integers(0, high + beyond, size=(50, len(shape)))
            got = _distinct_rows(offsets, shape)
            rows, first, group, counts = np.unique(
                offsets, axis=0, return_index=True, return_inverse=True, return_counts=True
            )
            assert np.array_equal(got[0], rows) and np.array_equal(got[1], first)
            assert np.array_equal(got[2], group.reshape(-1)) and np.array_equal(got[3], counts)


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), MESHES)
def test_the_layouts_arithmetic_is_torchs(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...]
) -> None:
    """Every mesh position's chunk, against torch's ``_compute_local_shape_and_global_offset``;
    every distinct chunk written by exactly one of the ranks that hold it."""
    import numpy as np
    from torch.distributed.checkpoint.metadata import TensorProperties

    from shardkit.core.checkpoint.local_plan.chunk_geometry import _position_chunks

    positions = int(np.prod(mesh_shape))
    mesh = np.arange(positions, dtype=np.int64).reshape(mesh_shape)
    floats = TensorProperties(dtype=torch.float32)
    value = ValueLayout("w", "dtensor", shape, floats, mesh, placements)
    offsets, sizes = _position_chunks(value)
    for position in range(positions):
        coordinate = [int(c) for c in np.unravel_index(position, mesh_shape)]
        size, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, coordinate, list(placements)
        )
        assert (tuple(sizes[position]), tuple(offsets[position])) == (size, offset), coordinate
    values = [ValueLayout(f"w{i}", "dtensor", shape, floats, mesh, placements) for i in range(3)]
    layout = SaveLayout(values, positions, "")
    geometry = layout.geometry(value)
    distinct = {tuple(o) for o in offsets.tolist()}
    assert {tuple(o) for o in geometry.offsets.tolist()} == distinct
    for ordinal in range(3):  # these chunks are too small to cut: each written whole, once
        pieces, _ = layout.pieces(ordinal)
        writers = layout.writers(ordinal, pieces).tolist()
        for writer, offset in zip(writers, geometry.offsets.tolist(), strict=True):
            assert tuple(offsets[writer]) == tuple(offset)  # the writer holds what it writes
        written = [i for rank in range(positions) for i in layout.items_of(rank)]
        indexes = [i.index.index for i in written if i.index.fqn == f"w{ordinal}"]
        mine = sorted(index for index in indexes if index is not None)
        assert len(mine) == len(indexes)  # every item of a tensor names its chunk
        assert mine == list(range(len(distinct)))
    assert sum(layout.expected_items()) == 3 * len(distinct)


def _save_locally(rank: int, world_size: int, root: str) -> None:
    from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
    from shardkit.core.runtime.groups import checkpoint_group

    state = _trained_state(rank, [world_size], 7)
    save_planned_locally(state, Path(root), LayoutCache(), checkpoint_group())


def _load_with_torch(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """torch's own load (``dcp.load``, ``set_state_dict``) into torch's ``fully_shard``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = _model(7, seed=1)  # other weights than the saved ones: the load replaces them all
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # the optimizer's state exists, to be overwritten
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp_load({"model": model_state, "optim": optim_state}, checkpoint_id=root)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    state: Any = get_state_dict(model, optimizer)  # nested dicts of tensors
    full = {f"model.{k}": _whole(v) for k, v in state[0].items()}
    for fqn, entries in state[1]["state"].items():
        for key, value in entries.items():
            full[f"optim.state.{fqn}.{key}"] = _whole(value)
    return full


def _whole(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def test_torchs_load_reshards_a_local_plan_checkpoint(tmp_path: Path) -> None:
    """Saved at W=2, loaded by torch's own code at W=1 (in this process), 3 and 4."""
    run_on_ranks(2, _save_locally, root=str(tmp_path / "ckpt"))
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=True)
    for world in (3, 4):
        loaded = run_on_ranks(world, _load_with_torch, root=str(tmp_path / "ckpt"))
        for name, tensor in loaded[0].items():
            section, _, key = name.partition(".")
            expected = saved[section][key] if section == "model" else None
            if expected is None:
                fqn, _, field = key.removeprefix("state.").rpartition(".")
                expected = saved["optim"]["state"][fqn][field]
            assert torch.equal(tensor, expected), (world, name)


def _stages_save(rank: int, world_size: int, root: str, how: str) -> dict[str, Any]:
    """Each rank a pipeline stage on a mesh of its own (``how="stages"``), or every rank on
    the world's mesh with one key of its own (``how="own key"``): each rank's keys are not
    the others'. Saved twice through the manager; the first save learns it, the second goes
    straight to DCP's planning."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from shardkit.core import CheckpointManager, fully_shard

    torch.manual_seed(rank)
    stage = torch.nn.Linear(4, 6)
    own = how == "stages"
    mesh = DeviceMesh("cpu", [rank]) if own else init_device_mesh("cpu", (world_size,))
    fully_shard(stage, mesh=mesh)
    state: dict[str, Any] = {f"stage{rank if how == 'stages' else 0}": get_model_state_dict(stage)}
    if how == "own key":
        state[f"rank{rank}"] = torch.full((2,), float(rank))
    manager = CheckpointManager(root, keep=2)
    manager.save(1, state)
    reason = manager._layouts.dcp_reason
    manager.save(2, state)
    latest = manager.latest()
    return {"reason": reason, "latest": latest.name if latest is not None else None}


@pytest.mark.parametrize("how", ["stages", "own key"])
def test_a_state_whose_keys_differ_between_ranks_saves_through_dcp(
    how: str, tmp_path: Path
) -> None:
    results = run_on_ranks(2, _stages_save, root=str(tmp_path), how=how)
    assert results[0] == results[1] and results[0]["latest"] == "step_00000002"
    assert results[0]["reason"], results  # learned at the first save, on every rank
    dcp_to_torch_save(tmp_path / "step_00000002", tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=True)
    if how == "stages":
        assert {"stage0", "stage1"} <= saved.keys()
    else:
        assert {"stage0", "rank0", "rank1"} <= saved.keys()
        assert torch.equal(saved["rank1"], torch.full((2,), 1.0))
