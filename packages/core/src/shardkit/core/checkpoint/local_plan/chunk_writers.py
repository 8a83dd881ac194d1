"""Who writes which chunk of a checkpoint, computed by every rank alone from the sharding.

DCP plans a save by gathering every rank's local plan to rank 0, which removes the chunks
that several ranks hold, builds the metadata, checks it and scatters the plans back: at
thousands of ranks that exchange, and rank 0's work on it, take minutes (pytorch#163548). But
a DTensor's chunks are a pure function of its global shape, its mesh and its placements, so
every rank can compute every rank's chunk of it, and no plan needs to travel.

:class:`SaveLayout` is that computation for a flat state dict (DCP's flattened keys):

- a :class:`Geometry` per distinct (shape, mesh, placements) (``chunk_geometry``): the
  chunk at every position of the mesh, grouped into distinct chunks. A model has few
  geometries (a Llama: about ten), however many tensors and ranks;
- which rank writes each distinct chunk: one of the ranks that hold it (several do under HSDP,
  and where shards are empty), shared by bytes (``replica_shares``): a large chunk is cut by
  rows into pieces that its holders write apart, so the busiest rank writes at most 9/8 of
  the mean. Tensors that are not DTensors and values that are not tensors are held by every
  rank, as DCP treats them, and are spread over the ranks;
- the checkpoint's ``state_dict_metadata``: every item (chunk, or piece of one) of every
  tensor as DCP's format lists them, chunk by chunk in order of their offsets. The tensors of
  one geometry cut alike share one list, so the metadata is built once per geometry and cut,
  and pickled once per list too (pickle writes a shared object once).

Per rank, after the geometries (O(W log W) each, once per layout), its own items take O(1) per
tensor. Rank 0's metadata and its check of every rank's results are O(chunks); the layout is
kept while the state's layout stays the same (:attr:`SaveLayout.digest`).

Next to split off: the questions of who writes what (``own_items``, ``writes_of_ranks``,
``writers``), into a ``writer_queries`` module beside ``replica_shares``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from shardkit.core.checkpoint.local_plan.chunk_geometry import Geometry, ValueLayout, mesh_key
from shardkit.core.checkpoint.local_plan.replica_shares import (
    Demand,
    Pieces,
    Share,
    shares_by_bytes,
    shares_by_turns,
)
from shardkit.core.checkpoint.local_plan.sharded_tensor_chunks import ShardedParts

__all__ = ["Geometry", "OwnItems", "SaveLayout", "ValueLayout", "mesh_key"]

_CHUNKED = frozenset({"dtensor", "sharded"})  # values whose chunks the ranks hold apart


@dataclass(frozen=True, slots=True)
class OwnItems:
    """What one rank writes: its items, and where one is a row piece of what the rank holds."""

    items: list[WriteItem]
    rows: dict[str, tuple[int, int]]
    """Per key written as a piece: its (first row, rows) in the rank's own chunk (dim 0)."""


@dataclass(slots=True)
class SaveLayout:
    """The save plan of a flat state dict on a world of ``world_size`` ranks."""

    values: list[ValueLayout]
    world_size: int
    digest: str
    rule: str = "bytes"
    """How the holders of a chunk share its writing (``replica_shares``): ``"bytes"``, or
    ``"turns"`` (whole chunks by the ordinal's turn: records of version 1)."""
    geometries: dict[tuple[Any, ...], Geometry] = field(default_factory=dict)
    _at: dict[int, Geometry] = field(default_factory=dict)
    _positions: dict[str, dict[int, int]] = field(default_factory=dict)
    _metadata: dict[str, STORAGE_TYPES] | None = None
    _written: list[list[MetadataIndex]] | None = None
    _shares: list[dict[int, Share]] | None = None
    _first_turns: dict[int, np.ndarray] | None = None
    _grouped: tuple[np.ndarray, list[np.ndarray]] | None = None
    _cut_values: np.ndarray | None = None
    _cuts: list[tuple[tuple[int, int], ...]] | None = None
    last_storage: tuple[torch.Tensor, dict[MetadataIndex, Any]] | None = None
    """Rank 0: the last save's result rows (all ranks') and the storage entries made of them."""

    @staticmethod
    def of(
        state_dict: dict[str, Any], world_size: int, sharded: ShardedParts | None = None
    ) -> SaveLayout:
        """The layout of a flat state dict (DCP's planner flattens it first).

        ``sharded``: FSDP1's ShardedTensors' shards as read at earlier saves (kept per layout).
        """
        meshes: dict[int, tuple[np.ndarray, str]] = {}
        parts = sharded if sharded is not None else ShardedParts()
        values = [_value_layout(fqn, value, meshes, parts) for fqn, value in state_dict.items()]
        return SaveLayout.from_values(values, world_size)

    @staticmethod
    def from_values(values: list[ValueLayout], world_size: int, rule: str = "bytes") -> SaveLayout:
        """The layout of values described already (a benchmark's simulated ranks, a record)."""
        text = f"{world_size}\n" + "\n".join(v.describe() for v in values)
        return SaveLayout(values, world_size, hashlib.sha256(text.encode()).hexdigest(), rule)

    def geometry(self, value: ValueLayout) -> Geometry:
        """The geometry of a DTensor value (computed once per distinct one)."""
        key = value.geometry_key()
        found = self.geometries.get(key)
        if found is None:
            found = self.geometries[key] = Geometry.of(value, self._positions)
        return found

    def geometry_at(self, ordinal: int) -> Geometry:
        """:meth:`geometry` of the value at ``ordinal`` (its key hashed once, not per ask)."""
        found = self._at.get(ordinal)
        if found is None:
            found = self._at[ordinal] = self.geometry(self.values[ordinal])
        return found

    def shares(self) -> list[dict[int, Share]]:
        """Per value, per holder count of its chunks, how its holders share the writing."""
        if self._shares is None:
            demands: list[list[Demand]] = []
            for value in self.values:
                if value.kind not in _CHUNKED:
                    demands.append([])
                    continue
                assert value.properties is not None
                itemsize = value.properties.dtype.itemsize
                demands.append(self.geometry(value).demands(itemsize))
            by_turns = self.rule == "turns"
            self._shares = shares_by_turns(demands) if by_turns else shares_by_bytes(demands)
        return self._shares

    def cuts(self, ordinal: int) -> tuple[tuple[int, int], ...]:
        """How a chunked value's chunks are cut: (holders, pieces) pairs where cut."""
        if self._cuts is None:
            self._cuts = [
                tuple(sorted((r, s.pieces) for r, s in shares.items() if s.pieces > 1))
                for shares in self.shares()
            ]
        return self._cuts[ordinal]

    def pieces(self, ordinal: int) -> tuple[Pieces, list[ChunkStorageMetadata]]:
        """The items of a chunked value (its chunks, cut where its shares say) and listing."""
        return self.geometry_at(ordinal).pieces(self.cuts(ordinal))

    def cut_pieces(self, ordinal: int) -> Pieces:
        """:meth:`pieces` without the listing (a load lists only the items it touches)."""
        return self.geometry_at(ordinal).cut_pieces(self.cuts(ordinal))

    def writers(self, ordinal: int, pieces: Pieces, items: np.ndarray | None = None) -> np.ndarray:
        """The global rank that writes each item of a chunked value (or each of ``items``)."""
        geometry = self.geometry_at(ordinal)
        chunk = pieces.chunk if items is None else pieces.chunk[items]
        piece = pieces.piece if items is None else pieces.piece[items]
        turn = np.zeros(chunk.size, dtype=np.int64)
        holders = geometry.counts[chunk]
        for count, share in self.shares()[ordinal].items():
            if count > 1:
                mine = holders == count
                turn[mine] = np.array(share.turns, dtype=np.int64)[piece[mine]]
        picked: np.ndarray = geometry.ranks[geometry.holders[geometry.first[chunk] + turn]]
        return picked

    def own_items(self, rank: int) -> OwnItems:
        """The write items rank ``rank`` writes, in state-dict order (DCP's local order)."""
        items: list[WriteItem] = []
        rows: dict[str, tuple[int, int]] = {}
        plain = 0
        shares = self.shares()
        for ordinal, value in enumerate(self.values):
            if value.kind not in _CHUNKED:
                # Held by every rank: written by one, spread over the ranks value by value.
                if plain % self.world_size == rank:
                    items.append(_whole_item(value))
                plain += 1
                continue
            geometry = self.geometry(value)
            position = geometry.position_of.get(rank)
            if position is None:
                continue
            chunk = int(geometry.group_of[position])
            share = shares[ordinal][int(geometry.counts[chunk])]
            pieces, _ = self.pieces(ordinal)
            first, end = int(pieces.start[chunk]), int(pieces.start[chunk + 1])
            turn = int(geometry.turn_of[position])
            for item in range(first, end):
                if share.turns[item - first] == turn:
                    items.append(_chunk_item(value, pieces, item))
                    if end - first > 1:
                        start = int(pieces.offsets[item, 0] - geometry.offsets[chunk, 0])
                        rows[value.fqn] = (start, int(pieces.sizes[item, 0]))
        return OwnItems(items, rows)

    def items_of(self, rank: int) -> list[WriteItem]:
        """The write items rank ``rank`` writes (:meth:`own_items`' items)."""
        return self.own_items(rank).items

    def writes_of(self, rank: int) -> np.ndarray:
        """Value ordinal -> whether ``rank`` writes an item of it (:meth:`writes_of_ranks`)."""
        found: np.ndarray = self.writes_of_ranks(np.array([rank], dtype=np.int64))[0]
        return found

    def writes_of_ranks(self, ranks: np.ndarray) -> np.ndarray:
        """(ranks, values): whether each of ``ranks`` writes an item of each value.

        Vectorized over the ranks as well as per geometry: a rank that loads a shard cut into
        row pieces reads from one writer per piece (up to one per replica, thousands under
        HSDP), and asking for each writer apart cost a Python pass over the values each.
        """
        writes = np.zeros((ranks.size, len(self.values)), dtype=bool)
        plain, by_geometry = self._ordinals()
        if plain.size:
            writes[:, plain] = (np.arange(plain.size) % self.world_size)[None, :] == ranks[:, None]
        first_turns, shares, cut = self._turn_tables(), self.shares(), self._cut()
        for ordinals in by_geometry:
            geometry = self.geometry(self.values[int(ordinals[0])])
            found = [geometry.position_of.get(r, -1) for r in ranks.tolist()]
            positions = np.array(found, dtype=np.int64)
            rows = np.flatnonzero(positions >= 0)
            if not rows.size:
                continue
            chunk = geometry.group_of[positions[rows]]
            count, turn = geometry.counts[chunk], geometry.turn_of[positions[rows]]
            cut_ordinals = ordinals[cut[ordinals]].tolist()
            for holders in np.unique(count).tolist():
                mine = count == holders
                at, turns = rows[mine], turn[mine]
                first = first_turns[holders][ordinals]
                writes[np.ix_(at, ordinals)] = first[None, :] == turns[:, None]
                for ordinal in cut_ordinals:  # a later piece of a cut chunk
                    share = shares[ordinal][holders]
                    place = np.full(holders, -1, dtype=np.int64)  # turn -> its piece
                    place[list(share.turns)] = np.arange(len(share.turns))
                    starts = self.cut_pieces(ordinal).start
                    items = starts[chunk[mine] + 1] - starts[chunk[mine]]
                    piece = place[turns]
                    writes[at, ordinal] |= (piece >= 1) & (piece < items)
        return writes

    def _ordinals(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """The ordinals of the values every rank holds, and of the chunked ones per geometry."""
        if self._grouped is None:
            by_geometry: dict[tuple[Any, ...], list[int]] = {}
            for i, value in enumerate(self.values):
                if value.kind in _CHUNKED:
                    by_geometry.setdefault(value.geometry_key(), []).append(i)
            plain = [i for i, v in enumerate(self.values) if v.kind not in _CHUNKED]
            groups = [np.array(o, dtype=np.int64) for o in by_geometry.values()]
            self._grouped = (np.array(plain, dtype=np.int64), groups)
        return self._grouped

    def _cut(self) -> np.ndarray:
        """Value ordinal -> whether a chunk of it is cut into pieces (built once)."""
        if self._cut_values is None:
            cut = [any(s.pieces > 1 for s in v.values()) for v in self.shares()]
            self._cut_values = np.array(cut, dtype=bool)
        return self._cut_values

    def _turn_tables(self) -> dict[int, np.ndarray]:
        """Per holder count: each value's turn that writes its first piece (-1: none)."""
        if self._first_turns is None:
            tables: dict[int, np.ndarray] = {}
            for ordinal, shares in enumerate(self.shares()):
                for count, share in shares.items():
                    table = tables.setdefault(count, np.full(len(self.values), -1, np.int64))
                    table[ordinal] = share.turns[0]
            self._first_turns = tables
        return self._first_turns

    def expected_items(self) -> list[int]:
        """How many items each rank writes (rank 0 checks every rank's results against it)."""
        return [len(keys) for keys in self.written()]

    def entry_count(self) -> int:
        """``.metadata``'s storage entries: every item of every rank.

        One per value held by every rank, one per piece of every chunk: what the planner and
        the benchmarks report.
        """
        total = 0
        for ordinal, value in enumerate(self.values):
            total += self.pieces(ordinal)[0].chunk.size if value.kind in _CHUNKED else 1
        return total

    def written(self) -> list[list[MetadataIndex]]:
        """Per rank, the keys of the items it writes, in its items' order (built once).

        Rank 0 pairs them with each rank's results. The keys share their offsets with the
        metadata's chunks (pickle then writes each offset once), and are made without
        ``MetadataIndex``'s conversion of the offsets (millions of them at thousands of ranks).
        """
        if self._written is not None:
            return self._written
        keys: list[list[MetadataIndex]] = [[] for _ in range(self.world_size)]
        plain = 0
        for ordinal, value in enumerate(self.values):
            if value.kind not in _CHUNKED:
                offsets = None if value.kind == "bytes" else torch.Size([0] * len(value.shape))
                hint = None if offsets is None else 0
                keys[plain % self.world_size].append(_key(value.fqn, offsets, hint))
                plain += 1
                continue
            pieces, listed = self.pieces(ordinal)
            for item, writer in enumerate(self.writers(ordinal, pieces).tolist()):
                keys[writer].append(_key(value.fqn, listed[item].offsets, item))
        self._written = keys
        return keys

    def state_dict_metadata(self) -> dict[str, STORAGE_TYPES]:
        """Every value's storage metadata, every item of every tensor (built once)."""
        if self._metadata is not None:
            return self._metadata
        metadata: dict[str, STORAGE_TYPES] = {}
        for ordinal, value in enumerate(self.values):
            if value.kind == "bytes":
                metadata[value.fqn] = BytesStorageMetadata()
                continue
            assert value.properties is not None
            size = torch.Size(value.shape)
            if value.kind == "tensor":
                chunk = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
                metadata[value.fqn] = TensorStorageMetadata(value.properties, size, [chunk])
                continue
            listed = self.pieces(ordinal)[1]
            metadata[value.fqn] = TensorStorageMetadata(value.properties, size, listed)
        self._metadata = metadata
        return metadata


def _value_layout(
    fqn: str, value: Any, meshes: dict[int, tuple[np.ndarray, str]], sharded: ShardedParts
) -> ValueLayout:
    if isinstance(value, ShardedTensor):
        shape, properties, ranks, placements = sharded.parts(fqn, value)
        return ValueLayout(fqn, "sharded", shape, properties, ranks, placements, mesh_key(ranks))
    if isinstance(value, DTensor):
        device_mesh = value.device_mesh
        known = meshes.get(id(device_mesh))
        if known is None:
            ranks = device_mesh.mesh.cpu().numpy().astype(np.int64)
            known = meshes[id(device_mesh)] = (ranks, mesh_key(ranks))
        return ValueLayout(
            fqn,
            "dtensor",
            tuple(value.shape),
            TensorProperties.create_from_tensor(value.to_local()),
            known[0],
            tuple(value.placements),
            known[1],
        )
    if isinstance(value, torch.Tensor):
        return ValueLayout(
            fqn, "tensor", tuple(value.shape), TensorProperties.create_from_tensor(value)
        )
    return ValueLayout(fqn, "bytes")


def _key(fqn: str, offsets: torch.Size | None, hint: int | None) -> MetadataIndex:
    """A ``MetadataIndex`` holding ``offsets`` itself (its constructor would copy them).

    Its fields set in its ``__dict__`` directly (it is a frozen dataclass without slots):
    rank 0 makes one per chunk of every tensor, millions at thousands of ranks.
    """
    key = object.__new__(MetadataIndex)
    fields = key.__dict__
    fields["fqn"], fields["offset"], fields["index"] = fqn, offsets, hint
    return key


def _whole_item(value: ValueLayout) -> WriteItem:
    if value.kind == "bytes":
        return WriteItem(index=MetadataIndex(value.fqn), type=WriteItemType.BYTE_IO)
    assert value.properties is not None
    size = torch.Size(value.shape)
    chunk = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
    return WriteItem(
        index=MetadataIndex(value.fqn, chunk.offsets, 0),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(chunk=chunk, properties=value.properties, size=size),
    )


def _chunk_item(value: ValueLayout, pieces: Pieces, item: int) -> WriteItem:
    assert value.properties is not None
    offsets = torch.Size(pieces.offsets[item].tolist())
    written = ChunkStorageMetadata(offsets, torch.Size(pieces.sizes[item].tolist()))
    return WriteItem(
        # The hint is the item's place in the metadata's list (DCP's global plan sets it).
        index=MetadataIndex(value.fqn, offsets, item),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=written, properties=value.properties, size=torch.Size(value.shape)
        ),
    )
