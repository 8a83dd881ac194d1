"""Even writes under HSDP (``checkpoint/local_plan/replica_shares.py``), issue 85.

The holders of a chunk share its writing by bytes, large chunks cut by rows into pieces that
different replicas write. Checked in one process on layouts at thousands of ranks (the busiest
rank's bytes against the mean; every piece written by a rank that holds it; the pieces tile
every chunk; each rank's own items, the metadata's keys and the load side's lookup agree), and
on gloo at W=4 (HSDP 2x2): a state whose chunks are cut is saved by ``CheckpointManager`` and
loaded by each rank alone from the record, bit for bit DCP's own planned load of the same
checkpoint, at the same layout and resharded to FSDP at W=2; and written by the writer
processes (``writer="process"``), which cut the rows from the shared staging buffers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import Replicate, Shard

from harness.pool import run_on_ranks
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout, ValueLayout, mesh_key
from tests.core.checkpoint.checkpoint_app import TrainingApp, same_state, state_of
from tests.core.checkpoint.layouts import llama_8b_layout

FLOAT = TensorProperties(dtype=torch.float32)


def _bytes_per_rank(layout: SaveLayout) -> np.ndarray:
    data = np.zeros(layout.world_size, dtype=np.int64)
    for ordinal, value in enumerate(layout.values):
        if value.kind == "dtensor":
            pieces, _ = layout.pieces(ordinal)
            np.add.at(data, layout.writers(ordinal, pieces), pieces.sizes.prod(axis=1) * 4)
    return data


@pytest.mark.parametrize("world", [1024, 8192])
def test_the_busiest_rank_writes_at_most_a_quarter_more_than_the_mean(world: int) -> None:
    values = llama_8b_layout(world)
    even = _bytes_per_rank(SaveLayout.from_values(values, world))
    assert even.max() <= 1.25 * even.mean(), (even.max() / even.mean(), even.min())
    # The earlier rule (whole chunks, the replicas taking turns tensor by tensor) does not.
    turns = _bytes_per_rank(SaveLayout.from_values(values, world, rule="turns"))
    assert turns.max() > 2 * turns.mean()
    assert even.sum() == turns.sum()  # every byte written once either way


def test_the_least_loaded_turns_are_a_stable_sorts_first() -> None:
    """``least_loaded`` skips sorting every turn; its choice must be the stable sort's."""
    from shardkit.core.checkpoint.local_plan.replica_shares import least_loaded

    rng = np.random.default_rng(0)
    for _ in range(500):  # few distinct loads: many ties
        load = rng.integers(0, 4, size=int(rng.integers(1, 40)))
        count = int(rng.integers(1, load.size + 1))
        expected = np.argsort(load, kind="stable")[:count]
        assert least_loaded(load, count).tolist() == expected.tolist(), (load, count)


def _check_layout(layout: SaveLayout, ranks: list[int]) -> None:
    """Pieces tile their chunks and are written by holders; the views of who writes agree."""
    for ordinal, value in enumerate(layout.values):
        if value.kind != "dtensor":
            continue
        geometry = layout.geometry(value)
        pieces, listed = layout.pieces(ordinal)
        writers = layout.writers(ordinal, pieces)
        backwards = np.arange(pieces.chunk.size)[::-1].copy()  # a load's view: some items
        assert layout.writers(ordinal, pieces, backwards).tolist() == writers[::-1].tolist()
        assert geometry.listed_items_of(layout.cuts(ordinal), backwards.tolist()) == listed[::-1]
        for chunk in range(geometry.offsets.shape[0]):
            items = range(int(pieces.start[chunk]), int(pieces.start[chunk + 1]))
            rows = [int(pieces.sizes[i, 0]) if value.shape else 1 for i in items]
            assert len(rows) == 1 or sum(rows) == geometry.sizes[chunk, 0]
            assert len({int(writers[i]) for i in items}) == len(rows)  # apart
            for i in items:
                position = geometry.position_of[int(writers[i])]
                assert geometry.group_of[position] == chunk  # the writer holds it
                assert tuple(listed[i].offsets) == tuple(pieces.offsets[i].tolist())
    written = layout.written()
    together = layout.writes_of_ranks(np.array(ranks[::-1], dtype=np.int64))[::-1]
    for rank, writes_together in zip(ranks, together, strict=True):
        assert layout.writes_of(rank).tolist() == writes_together.tolist()
    for rank in ranks:
        own = layout.own_items(rank)
        assert [i.index for i in own.items] == written[rank]
        expected = {i.index.fqn for i in own.items}
        writes = layout.writes_of(rank)
        assert {v.fqn for v, w in zip(layout.values, writes, strict=True) if w} == expected


def test_pieces_tile_their_chunks_and_every_view_of_the_writers_agrees() -> None:
    layout = SaveLayout.from_values(llama_8b_layout(1024), 1024)
    assert any(s.pieces > 1 for shares in layout.shares() for s in shares.values())
    _check_layout(layout, [0, 1, 7, 8, 500, 1023])
    again = SaveLayout.from_values(llama_8b_layout(1024), 1024)  # another rank computes the same
    assert again.written() == layout.written()


def test_uneven_and_empty_chunks_on_a_small_mesh() -> None:
    mesh = np.arange(12, dtype=np.int64).reshape(3, 4)
    key = mesh_key(mesh)
    shapes = [(4099, 256), (3, 512), (0, 64), (4096,), (2, 700000), (5, 300000), ()]
    values = [
        ValueLayout(f"w{i}", "dtensor", s, FLOAT, mesh, (Replicate(), Shard(0)), key)
        for i, s in enumerate(shapes)
        if s
    ]
    values.append(
        ValueLayout("scalar", "dtensor", (), FLOAT, mesh, (Replicate(), Replicate()), key)
    )
    layout = SaveLayout.from_values(values, 12)
    assert any(s.pieces > 1 for shares in layout.shares() for s in shares.values())
    _check_layout(layout, list(range(12)))


def test_a_record_of_version_1_keeps_its_rule(tmp_path: Path) -> None:
    """Checkpoints written before the bytes rule (whole chunks by turns) still load."""
    from shardkit.core.checkpoint.local_plan.layout_record import read_record, write_record

    values = llama_8b_layout(64)
    for rule, version in (("turns", b"1"), ("bytes", b"3")):
        layout = SaveLayout.from_values(values, 64, rule=rule)
        write_record(tmp_path, layout, np.zeros((2, 3), dtype=np.int64))
        assert (tmp_path / "layout.json").read_bytes().split(b" ")[1] == version
        read = read_record(tmp_path).layout
        assert read.rule == rule
        assert read.written() == layout.written()


def _app(world_size: int, replicas: int, seed: int) -> TrainingApp:
    """Layers large enough that their chunks are cut into pieces under HSDP 2x2."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 1027),
        torch.nn.LayerNorm(1027),
    )
    if replicas == 1:
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        shape = (replicas, world_size // replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return TrainingApp(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager

    app = _app(world_size, 2, seed=0)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    app.model(x).square().mean().backward()
    app.optimizer.step()
    app.step = 1
    path = CheckpointManager(root).save(1, {"app": app})
    # The same state written by a writer process (its rows cut there, from shared memory).
    with CheckpointManager(f"{root}/process", writer="process") as manager:
        manager.save(1, {"app": app}, async_save=True)
    process = manager.path_for(1)
    return {"state": state_of(app), "path": str(path), "process": str(process)}


def _load(rank: int, world_size: int, path: str, replicas: int) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.tensor import DTensor

    from shardkit.core import CheckpointManager
    from shardkit.core.checkpoint.dcp_reading import SafeFileSystemReader, SafeLoadPlanner

    ours = _app(world_size, replicas, seed=7)
    manager = CheckpointManager(Path(path).parent)
    manager.load({"app": ours}, path)
    theirs = _app(world_size, replicas, seed=7)
    dcp_load(
        {"app": theirs},
        checkpoint_id=path,
        storage_reader=SafeFileSystemReader(path),
        planner=SafeLoadPlanner(),
    )
    flat, _ = flatten_state_dict({"app": ours.state_dict()})
    return {
        "ours": state_of(ours),
        "same_as_dcp": same_state(state_of(ours), state_of(theirs)),
        "bytes_read": manager.last_load_reads.bytes_read,
        "dtensor_keys": sorted(k for k, v in flat.items() if isinstance(v, DTensor)),
    }


def test_an_hsdp_checkpoint_written_in_pieces_loads_bit_for_bit(tmp_path: Path) -> None:
    from shardkit.core.checkpoint.dcp_reading import read_dcp_metadata

    saved = run_on_ranks(4, _save, root=str(tmp_path), timeout_s=900)  # 4 writer children start
    path = Path(saved[0]["path"])
    entry = read_dcp_metadata(path).state_dict_metadata["app.model.2.weight"]
    # (1027, 512) on 2 shards (514 and 513 rows), each cut in 2 row pieces: 4 chunks listed,
    # where DCP's own save lists 2.
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)  # type: ignore[union-attr]
    assert chunks == [
        ((0, 0), (257, 512)),
        ((257, 0), (257, 512)),
        ((514, 0), (257, 512)),
        ((771, 0), (256, 512)),
    ]
    files = [sum(f.stat().st_size for f in path.glob(f"__{r}_*.distcp")) for r in range(4)]
    assert max(files) <= 1.25 * np.mean(files), files
    for world, replicas in ((4, 2), (2, 1)):  # the same layout, and FSDP at W=2
        loaded = run_on_ranks(world, _load, path=str(path), replicas=replicas)
        for rank, result in enumerate(loaded):
            assert result["same_as_dcp"], (world, rank)
            assert same_state(result["ours"], saved[0]["state"]), (world, rank)
        if replicas == 2:  # each replica reads back the pieces it wrote (``replica_pieces``)
            stored = read_dcp_metadata(path).storage_data
            sharded = set(loaded[0]["dtensor_keys"])
            plain = sum(info.length for i, info in stored.items() if i.fqn not in sharded)
            for rank, result in enumerate(loaded):
                wrote = sum(
                    info.length
                    for i, info in stored.items()
                    if i.fqn in sharded and info.relative_path.startswith(f"__{rank}_")
                )
                assert result["bytes_read"] == wrote + plain, (rank, result["bytes_read"])
    by_process = run_on_ranks(4, _load, path=saved[0]["process"], replicas=2)
    for rank, result in enumerate(by_process):
        assert result["same_as_dcp"] and same_state(result["ours"], saved[0]["state"]), rank
