"""Where a rank's shards lie in a checkpoint with a layout record: the chunks, writers, bytes.

The reading side of ``chunk_writers``. From the record's layout every rank computes, alone:

- which saved chunks overlap each shard it holds: per geometry, the distinct chunks' offsets
  and sizes against the shard's box, vectorized over the chunks, once per (geometry, shard
  box) however many tensors share them;
- who wrote each such chunk: ``Geometry``'s rule (the holders taking turns by the value's
  ordinal);
- where it lies: the writer's row in its index (``rank_index``). A writer's rows follow its
  items' order, so its row of a value is how many of the values before it the writer wrote,
  counted with numpy per geometry (a writer writes a value of a geometry iff the value's
  ordinal falls on its turn among its chunk's holders), for all the writers of the rank's
  items at once (under HSDP's even writes a shard meets up to one row piece per replica:
  one Python pass per writer made the plan grow with the replicas). Values that every rank
  holds are placed by the record itself (rank 0 finds their rows the same way, in what it
  gathered: :func:`plain_locations`), so that no rank opens the indexes of all their writers.

The result is the part of DCP's ``Metadata`` this rank's load needs: the entries of its own
keys, only the chunks (or pieces) that touch its shards, each listed alone, their storage
entries; of a key whose replicas split its reading by items (``replica_pieces``), only the
items this replica reads, chosen with numpy before any of them is listed. DCP's load planner
and reader then run on it unchanged, on this rank alone. Work per rank: the record's values,
plus its own shards and the chunks that touch them (numpy), plus a Python step per item it
reads and one index per writer it reads from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from shardkit.core.checkpoint.local_plan.chunk_writers import Geometry, SaveLayout, ValueLayout
from shardkit.core.checkpoint.local_plan.rank_index import data_file, read_index
from shardkit.core.checkpoint.local_plan.replica_pieces import PieceSplit, unit_boxes

__all__ = ["Boxes", "ChunkSources", "boxes_held", "plain_locations"]

_CHUNKED = frozenset({"dtensor", "sharded"})
_WRITERS_AT_ONCE = 256

Boxes = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None
"""The (offsets, sizes) boxes a rank holds of a value; None: the whole value."""


class ChunkSources:
    """A recorded checkpoint, as this rank looks up where its shards lie."""

    def __init__(self, folder: Path, layout: SaveLayout, plain: np.ndarray | None = None) -> None:
        """``plain``: the record's places of the values every rank holds (``Record.plain``)."""
        self.folder, self.layout, self.plain = folder, layout, plain
        values = layout.values
        self.ordinal = {value.fqn: i for i, value in enumerate(values)}
        held_by_all = [i for i, value in enumerate(values) if value.kind not in _CHUNKED]
        self.plain_ordinals = np.array(held_by_all, dtype=np.int64)
        self.plain_turn = {ordinal: turn for turn, ordinal in enumerate(held_by_all)}
        self._rows: dict[int, np.ndarray] = {}  # writer -> value ordinal -> its row (-1: none)
        self._indexes: dict[int, np.ndarray] = {}  # writer -> its index's rows
        self._touching: dict[tuple[Any, ...], np.ndarray] = {}
        self._items: dict[tuple[Any, ...], np.ndarray] = {}
        self._unit_boxes: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def written_by(self, writer: int) -> np.ndarray:
        """Value ordinal -> its row in ``writer``'s index, -1 where it wrote none of it."""
        found = self._rows.get(writer)
        if found is None:
            self.learn_writers([writer])
            found = self._rows[writer]
        return found

    def learn_writers(self, writers: list[int]) -> None:
        """:meth:`written_by` of each of ``writers``, computed together (numpy over them).

        In batches of :data:`_WRITERS_AT_ONCE`, which bounds the (writers, values) tables.
        """
        new = sorted(set(writers).difference(self._rows))
        for at in range(0, len(new), _WRITERS_AT_ONCE):
            batch = np.array(new[at : at + _WRITERS_AT_ONCE], dtype=np.int64)
            writes = self.layout.writes_of_ranks(batch)  # the save's rule (``replica_shares``)
            rows = np.where(writes, np.cumsum(writes, axis=1) - 1, -1)
            for i, writer in enumerate(batch.tolist()):
                self._rows[writer] = rows[i]

    def index_of(self, writer: int) -> np.ndarray:
        """``writer``'s index rows, read and checked once."""
        found = self._indexes.get(writer)
        if found is None:
            items = int((self.written_by(writer) >= 0).sum())
            found = self._indexes[writer] = read_index(self.folder, writer, items)
        return found

    def metadata_for(
        self,
        flat: dict[str, Any],
        skipped: frozenset[str] = frozenset(),
        splits: Mapping[str, PieceSplit] | None = None,
    ) -> Metadata:
        """DCP's metadata for loading ``flat`` on this rank: its keys, the chunks it reads.

        ``skipped``: keys this rank does not read (another replica reads them): listed, with
        no chunk to read. ``splits``: keys whose saved items the replicas split between them
        (``replica_pieces``): listed with the items this rank reads; each split's units set.
        """
        held = {fqn: boxes_held(target) for fqn, target in flat.items()}
        return self.metadata_of(held, skipped, splits)

    def metadata_of(
        self,
        held: dict[str, Boxes],
        skipped: frozenset[str] = frozenset(),
        splits: Mapping[str, PieceSplit] | None = None,
    ) -> Metadata:
        """:meth:`metadata_for`, from the boxes this rank holds of each key.

        A benchmark's simulated ranks give the boxes directly.
        """
        splits = {} if splits is None else splits
        entries: dict[str, STORAGE_TYPES] = {}
        # Each entry's place, or the (writer, value) whose index row gives it: the writers'
        # rows are computed together once all are known (``learn_writers``).
        storage: dict[MetadataIndex, _StorageInfo | tuple[int, int]] = {}
        for fqn, boxes in held.items():
            ordinal = self.ordinal.get(fqn)
            if ordinal is None:
                continue  # DCP's planner reports the missing key
            value = self.layout.values[ordinal]
            if value.kind == "bytes":
                entries[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = self._where_plain(ordinal)
                continue
            assert value.properties is not None
            size = torch.Size(value.shape)
            if value.kind == "tensor":
                whole = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
                entries[fqn] = TensorStorageMetadata(value.properties, size, [whole])
                if fqn not in skipped:
                    storage[MetadataIndex(fqn, whole.offsets, 0)] = self._where_plain(ordinal)
                continue
            chunks: list[ChunkStorageMetadata] = []
            entries[fqn] = TensorStorageMetadata(value.properties, size, chunks)
            if fqn in skipped:
                continue
            geometry = self.layout.geometry_at(ordinal)
            # A chunk its holders wrote in row pieces (``replica_shares``) lists each piece.
            cuts, pieces = self.layout.cuts(ordinal), self.layout.cut_pieces(ordinal)
            items = self._items_touching(value, geometry, boxes, cuts)
            found = self.layout.writers(ordinal, pieces, items)
            split = splits.get(fqn)
            if split is not None and boxes is not None and len(boxes) == 1:
                # Only the items this replica reads are listed (and planned, and looked up).
                itemsize = value.properties.dtype.itemsize
                units = self._units(geometry, boxes, cuts, itemsize)
                mine = split.take(units, found)
                items, found = items[mine], found[mine]
            writers = found.tolist()
            chunks.extend(geometry.listed_items_of(cuts, items.tolist()))
            for index, (chunk, writer) in enumerate(zip(chunks, writers, strict=True)):
                storage[MetadataIndex(fqn, chunk.offsets, index)] = (writer, ordinal)
        self.learn_writers([w[0] for w in storage.values() if isinstance(w, tuple)])
        placed = {
            key: self._where(*where) if isinstance(where, tuple) else where
            for key, where in storage.items()
        }
        return Metadata(state_dict_metadata=entries, storage_data=placed)

    def _plain_writer(self, ordinal: int) -> int:
        return self.plain_turn[ordinal] % self.layout.world_size

    def _where_plain(self, ordinal: int) -> _StorageInfo:
        if self.plain is None:  # a benchmark's or a test's: from the writer's index
            return self._where(self._plain_writer(ordinal), ordinal)
        number, offset, length = self.plain[self.plain_turn[ordinal]].tolist()
        return _StorageInfo(data_file(self._plain_writer(ordinal), number), offset, length)

    def _where(self, writer: int, ordinal: int) -> _StorageInfo:
        row = int(self.written_by(writer)[ordinal])
        assert row >= 0, "the layout names this writer for the value"
        number, offset, length = self.index_of(writer)[row].tolist()
        return _StorageInfo(data_file(writer, number), offset, length)

    def _items_touching(
        self, value: ValueLayout, geometry: Geometry, boxes: Boxes, cuts: tuple[Any, ...]
    ) -> np.ndarray:
        """The items (chunks, or their pieces as ``cuts`` cut them) that overlap ``boxes``.

        Once per (geometry, boxes, cut): the tensors of one shape cut alike share them.
        """
        key = (id(geometry), boxes, cuts)  # a layout's geometries live as long as it
        found = self._items.get(key)
        if found is None:
            pieces = geometry.cut_pieces(cuts)
            touching = self._chunks_touching(value, geometry, boxes)
            found = self._items[key] = _items_of(pieces.start, touching)
        return found

    def _units(
        self, geometry: Geometry, boxes: Boxes, cuts: tuple[Any, ...], itemsize: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`unit_boxes` of the items touching the one box, once per (geometry, cut)."""
        key = (id(geometry), boxes, cuts, itemsize)
        found = self._unit_boxes.get(key)
        if found is None:
            assert boxes is not None and len(boxes) == 1
            items = self._items[(id(geometry), boxes, cuts)]
            pieces = geometry.cut_pieces(cuts)
            own = (pieces.offsets[items], pieces.sizes[items])
            found = self._unit_boxes[key] = unit_boxes(boxes[0], own, itemsize)
        return found

    def _chunks_touching(self, value: ValueLayout, geometry: Geometry, boxes: Boxes) -> np.ndarray:
        """The saved chunks (their indices) that overlap ``boxes`` (None: the whole value)."""
        if boxes is None:
            boxes = (((0,) * len(value.shape), value.shape),)
        key = (id(geometry), boxes)
        found = self._touching.get(key)
        if found is not None:
            return found
        hits = np.zeros(geometry.offsets.shape[0], dtype=bool)
        starts, ends = geometry.offsets, geometry.offsets + geometry.sizes  # (chunks, ndim)
        nonempty = (geometry.sizes > 0).all(axis=1)
        for offsets, sizes in boxes:
            if 0 in sizes:
                continue
            low, high = np.array(offsets), np.array(offsets) + np.array(sizes)
            hits |= nonempty & ((starts < high) & (low < ends)).all(axis=1)
        found = self._touching[key] = np.flatnonzero(hits)
        return found


def _items_of(start: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """The items of ``chunks`` (ascending), in order: ``start[c]:start[c + 1]`` of each."""
    counts = start[chunks + 1] - start[chunks]
    first = np.repeat(start[chunks] - np.cumsum(counts) + counts, counts)
    found: np.ndarray = first + np.arange(int(counts.sum()), dtype=np.int64)
    return found


def boxes_held(target: Any) -> Boxes:
    """The (offsets, sizes) boxes this rank holds of a value (DCP's chunk list); None: all."""
    if isinstance(target, DTensor):
        chunks = target.__create_chunk_list__()
        return tuple((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
    if isinstance(target, ShardedTensor):
        chunks = [
            ChunkStorageMetadata(
                torch.Size(s.metadata.shard_offsets), torch.Size(s.metadata.shard_sizes)
            )
            for s in target.local_shards()
        ]
        return tuple((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
    return None  # a plain tensor (or a value): the whole of it


def plain_locations(layout: SaveLayout, bodies: list[torch.Tensor]) -> np.ndarray:
    """Rank 0, at a save: (values every rank holds, 3) file number, offset, length of each.

    ``bodies``: every rank's result rows as gathered (``save_results``), in its items' order.
    One pass per writer of such values (at most one per rank), numpy per geometry.

    Raises:
        RuntimeError: a rank sent fewer rows than the layout gives it.
    """
    sources = ChunkSources(Path(), layout)
    world = layout.world_size
    out = np.zeros((sources.plain_ordinals.size, 3), dtype=np.int64)
    # Every such writer's rows at once: one by one, each was a pass over the cut values
    # (1.5 s for 8B under HSDP at 1,024, 303 writers; 10 s for 70B at 8,192).
    sources.learn_writers([turn % world for turn in range(sources.plain_ordinals.size)])
    for turn, ordinal in enumerate(sources.plain_ordinals.tolist()):
        writer = turn % world
        row = int(sources.written_by(writer)[ordinal])
        rows = bodies[writer].view(-1)
        if rows.numel() < 4 * (row + 1):
            raise RuntimeError(f"rank {writer} sent {rows.numel() // 4} results, too few")
        out[turn] = rows[4 * row : 4 * row + 3].numpy()
    return out
