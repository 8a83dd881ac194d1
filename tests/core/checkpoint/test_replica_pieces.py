"""HSDP's read-once split by saved items (``checkpoint/local_plan/replica_pieces.py``), issue 85.

In one process, on an 8B Llama's layout with AdamW under HSDP (8 ranks a replica) at
thousands of ranks, as ``load.py`` plans a rank's load from the record: at the same layout a
rank plans exactly the items it wrote, from its own index only, so the items it plans do not
grow with the replicas; resharded to half the replicas, the replicas of a shard split its
items alike (each computes the split alone), every item read by one of them, their bytes
within one item of each other. The loads on gloo, bit for bit DCP's: ``test_replica_reads.py``
and ``test_even_writes.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.core.checkpoint.local_plan.chunk_sources import Boxes, ChunkSources
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.core.checkpoint.local_plan.replica_pieces import (
    PieceSplit,
    ReplicaLoads,
    replica_line,
)
from tests.core.checkpoint.layouts import llama_8b_layout


class _MadeUpIndexes(ChunkSources):
    """The writers' indexes made up (rows of the right count), the writers asked counted."""

    def index_of(self, writer: int) -> np.ndarray:
        found = self._indexes.get(writer)
        if found is None:
            rows = int((self.written_by(writer) >= 0).sum())
            found = self._indexes[writer] = np.tile(np.array([0, 0, 4096]), (rows, 1))
        return found


def _plan(saved: SaveLayout, loading: SaveLayout, rank: int) -> tuple[int, set[int], list[int]]:
    """``rank``'s plan: the chunk items it lists, the writers it asks, what its replicas read."""
    held = _held(loading, rank)
    splits: dict[str, PieceSplit] = {}
    loads: ReplicaLoads | None = None
    for value in loading.values:
        if value.kind != "dtensor":
            continue
        assert value.mesh is not None
        line = replica_line(value.mesh, value.placements, rank)
        assert line is not None
        if loads is None:  # one mesh: one set of replicas for every key
            loads = ReplicaLoads(line, int(np.flatnonzero(line == rank)[0]))
        splits[value.fqn] = PieceSplit(loads)
    sources = _MadeUpIndexes(Path(), saved)
    metadata = sources.metadata_of(held, splits=splits)
    items = sum(1 for index in metadata.storage_data if index.fqn in splits)
    assert loads is not None
    return items, set(sources._indexes), loads.loads.tolist()


def _held(layout: SaveLayout, rank: int) -> dict[str, Boxes]:
    """The box ``rank`` holds of each sharded value (None: the whole value)."""
    held: dict[str, Boxes] = {}
    for value in layout.values:
        if value.kind != "dtensor":
            held[value.fqn] = None
            continue
        geometry = layout.geometry(value)
        chunk = int(geometry.group_of[geometry.position_of[rank]])
        offsets, sizes = geometry.offsets[chunk].tolist(), geometry.sizes[chunk].tolist()
        held[value.fqn] = ((tuple(offsets), tuple(sizes)),)
    return held


def _written_chunk_items(layout: SaveLayout, rank: int) -> int:
    return sum(1 for item in layout.items_of(rank) if item.index.fqn not in ("step", "lr"))


@pytest.mark.parametrize("world", [1024, 8192])
def test_a_rank_plans_only_what_it_wrote_at_the_same_layout(world: int) -> None:
    layout = SaveLayout.from_values(llama_8b_layout(world), world)
    for rank in (0, world // 2 + 3, world - 1):
        items, writers, _ = _plan(layout, layout, rank)
        assert items == _written_chunk_items(layout, rank), rank
        # Its own index, and those of the ranks that wrote the step and the learning rate
        # (held by every rank: written by ranks 0 and 1; a real load finds them in the record).
        assert writers <= {rank, 0, 1}, (rank, sorted(writers)[:8])


def test_the_items_a_rank_plans_do_not_grow_with_the_replicas() -> None:
    """Split by tensors, the replica that drew the embedding planned its every row piece."""
    most = []
    for world in (1024, 8192):
        layout = SaveLayout.from_values(llama_8b_layout(world), world)
        most.append(max(_plan(layout, layout, rank)[0] for rank in (0, 7, world - 1)))
    assert most[1] <= most[0], most


def test_replicas_split_a_resharded_shard_alike_and_evenly() -> None:
    """Saved at 512 (64 replicas), loaded at 256 (32): each replica computes the split."""
    saved = SaveLayout.from_values(llama_8b_layout(512), 512)
    loading = SaveLayout.from_values(llama_8b_layout(256), 256)
    line = [r for r in range(256) if r % 8 == 3]  # the replicas of shard 3
    plans = [_plan(saved, loading, rank) for rank in line]
    loads = plans[0][2]
    assert all(plan[2] == loads for plan in plans)  # the same split, computed apart
    alone = _MadeUpIndexes(Path(), saved).metadata_of(_held(loading, 3))  # one rank, unsplit
    every = sum(1 for index in alone.storage_data if index.fqn not in ("step", "lr"))
    assert sum(plan[0] for plan in plans) == every  # each item read by one replica
    assert max(loads) <= 1.25 * np.mean(loads), (max(loads), np.mean(loads), min(loads))


def test_an_item_goes_to_its_writer_in_the_set_else_to_the_least_loaded() -> None:
    replicas = ReplicaLoads(np.array([40, 8, 24], dtype=np.int64), me=1)
    readers = replicas.readers(np.array([8, 99, 24, 98, 97, 96]), np.array([5, 1, 3, 2, 2, 2]))
    # 8 and 24 read what they wrote: loads 0, 5, 3. The four others in rounds of three: 98
    # and 97 (2 bytes each, the earlier first) to places 0 and 2, then 99 (1 byte) to 1;
    # loads 2, 6, 5; then 96 to place 0.
    assert readers.tolist() == [1, 1, 2, 0, 2, 0]
    assert replicas.loads.tolist() == [4, 6, 5]
    again = ReplicaLoads(np.array([40, 8, 24], dtype=np.int64), me=0)  # another replica
    assert (
        again.readers(np.array([8, 99, 24, 98, 97, 96]), np.array([5, 1, 3, 2, 2, 2])).tolist()
        == readers.tolist()
    )
