"""Who writes which chunk of a checkpoint, computed by every rank alone from the sharding.

DCP plans a save by gathering every rank's local plan to rank 0, which removes the chunks
that several ranks hold, builds the metadata, checks it and scatters the plans back: at
thousands of ranks that exchange, and rank 0's work on it, take minutes (pytorch#163548). But
a DTensor's chunks are a pure function of its global shape, its mesh and its placements, so
every rank can compute every rank's chunk of it, and no plan needs to travel.

:class:`SaveLayout` is that computation for a flat state dict (DCP's flattened keys):

- a :class:`Geometry` per distinct (shape, mesh, placements): the chunk at every position of
  the mesh, by torch.chunk's arithmetic per mesh dim (``Shard`` and ``Replicate``,
  vectorized over the positions; any other placement, ``_StridedShard`` among them, through
  torch's own per-coordinate function), grouped into distinct chunks (DCP's key: the
  offsets). A model has few geometries (a Llama: about ten), however many tensors and ranks;
- which rank writes each distinct chunk: one of the ranks that hold it (several do under HSDP,
  and where shards are empty), the replicas taking turns tensor by tensor, so each writes
  about 1/R of the bytes. Tensors that are not DTensors and values that are not tensors are
  held by every rank, as DCP treats them, and are spread over the ranks;
- the checkpoint's ``state_dict_metadata``: every chunk of every tensor as DCP's format lists
  them, in order of their offsets. The tensors of one geometry share one list of chunks, so
  the metadata is built once per geometry, and pickled once per geometry too (pickle writes
  a shared object once).

Per rank, after the geometries (O(W log W) each, once per layout), its own items take O(1) per
tensor. Rank 0's metadata and its check of every rank's results are O(chunks); the layout is
kept while the state's layout stays the same (:attr:`SaveLayout.digest`).
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
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardkit.core.checkpoint.local_plan.sharded_tensor_chunks import (
    shard_chunks,
    sharded_tensor_parts,
)
from shardkit.core.runtime.chunks import chunk_rows_array
from shardkit.core.runtime.dtensors import chunk_at

__all__ = ["Geometry", "SaveLayout", "ValueLayout", "mesh_key"]

_CHUNKED = frozenset({"dtensor", "sharded"})  # values whose chunks the ranks hold apart


@dataclass(frozen=True, slots=True)
class ValueLayout:
    """One value of the flat state dict, as far as the plan is concerned."""

    fqn: str
    kind: str
    """``"dtensor"``, ``"sharded"`` (FSDP1's ShardedTensor: ``sharded_tensor_chunks``),
    ``"tensor"`` (held whole by every rank) or ``"bytes"`` (not a tensor)."""
    shape: tuple[int, ...] = ()
    properties: TensorProperties | None = None
    mesh: np.ndarray | None = None
    """A DTensor's mesh: the global rank at each position (its shape is the mesh's); a
    ShardedTensor's: the global rank of each shard."""
    placements: tuple[Any, ...] = ()
    mesh_id: str = ""
    """:func:`mesh_key` of ``mesh`` (computed once per mesh, not per tensor)."""

    def describe(self) -> str:
        """Everything the plan depends on, as text (the layout's digest hashes it)."""
        props = self.properties
        dtype = "" if props is None else f"{props.dtype}|{props.pin_memory}|{props.requires_grad}"
        return f"{self.fqn}|{self.kind}|{self.shape}|{dtype}|{self.mesh_id}|{self.placements}"

    def geometry_key(self) -> tuple[Any, ...]:
        """What a DTensor's chunks depend on."""
        return (self.shape, self.mesh_id, self.placements)


def mesh_key(mesh: np.ndarray) -> str:
    """A mesh's identity: its shape and the global rank at each position."""
    return hashlib.sha256(f"{mesh.shape}".encode() + mesh.tobytes()).hexdigest()[:32]


@dataclass(slots=True)
class Geometry:
    """The distinct chunks of every DTensor of one (shape, mesh, placements)."""

    offsets: np.ndarray
    """(chunks, ndim), ascending (DCP's key; the metadata lists them in this order)."""
    sizes: np.ndarray
    group_of: np.ndarray
    """Mesh position -> its chunk."""
    holders: np.ndarray
    """Mesh positions, chunk by chunk (each chunk's holders in position order)."""
    first: np.ndarray
    """Where each chunk's holders start in ``holders``."""
    counts: np.ndarray
    """How many positions hold each chunk."""
    ranks: np.ndarray
    """Mesh position -> global rank."""
    position_of: dict[int, int]
    """Global rank -> its mesh position."""
    listed: list[ChunkStorageMetadata] = field(default_factory=list)
    """The chunks as the metadata lists them (built on first use, then shared)."""

    @staticmethod
    def of(value: ValueLayout) -> Geometry:
        """The geometry of a DTensor's layout."""
        assert value.mesh is not None
        offsets, sizes = _position_chunks(value)
        distinct, first_seen, group_of, counts = np.unique(
            offsets, axis=0, return_index=True, return_inverse=True, return_counts=True
        )
        group_of = group_of.reshape(-1)
        holders = np.argsort(group_of, kind="stable")
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        ranks = value.mesh.reshape(-1)
        return Geometry(
            offsets=distinct,
            sizes=sizes[first_seen],
            group_of=group_of,
            holders=holders,
            first=first,
            counts=counts,
            ranks=ranks,
            position_of={int(r): p for p, r in enumerate(ranks.tolist())},
        )

    def writers(self, ordinal: int) -> np.ndarray:
        """The global rank that writes each chunk of the ``ordinal``-th tensor."""
        picked: np.ndarray = self.ranks[self.holders[self.first + ordinal % self.counts]]
        return picked

    def chunk_written_by(self, rank: int, ordinal: int) -> int | None:
        """The chunk ``rank`` writes of the ``ordinal``-th tensor, or None."""
        position = self.position_of.get(rank)
        if position is None:
            return None
        group = int(self.group_of[position])
        pick = int(self.first[group]) + ordinal % int(self.counts[group])
        return group if int(self.holders[pick]) == position else None

    def chunk_list(self) -> list[ChunkStorageMetadata]:
        """Every chunk, as the metadata lists them (one list, shared by the tensors)."""
        if not self.listed:
            self.listed = [
                ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                for o, s in zip(self.offsets.tolist(), self.sizes.tolist(), strict=True)
            ]
        return self.listed


@dataclass(slots=True)
class SaveLayout:
    """The save plan of a flat state dict on a world of ``world_size`` ranks."""

    values: list[ValueLayout]
    world_size: int
    digest: str
    geometries: dict[tuple[Any, ...], Geometry] = field(default_factory=dict)
    _metadata: dict[str, STORAGE_TYPES] | None = None
    _written: list[list[MetadataIndex]] | None = None
    last_storage: tuple[torch.Tensor, dict[MetadataIndex, Any]] | None = None
    """Rank 0: the last save's result rows (all ranks') and the storage entries made of them."""

    @staticmethod
    def of(state_dict: dict[str, Any], world_size: int) -> SaveLayout:
        """The layout of a flat state dict (DCP's planner flattens it first)."""
        meshes: dict[int, tuple[np.ndarray, str]] = {}
        values = [_value_layout(fqn, value, meshes) for fqn, value in state_dict.items()]
        return SaveLayout.from_values(values, world_size)

    @staticmethod
    def from_values(values: list[ValueLayout], world_size: int) -> SaveLayout:
        """The layout of values described already (a benchmark's simulated ranks)."""
        text = f"{world_size}\n" + "\n".join(v.describe() for v in values)
        return SaveLayout(values, world_size, hashlib.sha256(text.encode()).hexdigest())

    def geometry(self, value: ValueLayout) -> Geometry:
        """The geometry of a DTensor value (computed once per distinct one)."""
        key = value.geometry_key()
        found = self.geometries.get(key)
        if found is None:
            found = self.geometries[key] = Geometry.of(value)
        return found

    def items_of(self, rank: int) -> list[WriteItem]:
        """The write items rank ``rank`` writes, in state-dict order (DCP's local order)."""
        items: list[WriteItem] = []
        plain = 0
        for ordinal, value in enumerate(self.values):
            if value.kind not in _CHUNKED:
                # Held by every rank: written by one, spread over the ranks value by value.
                if plain % self.world_size == rank:
                    items.append(_whole_item(value))
                plain += 1
                continue
            geometry = self.geometry(value)
            chunk = geometry.chunk_written_by(rank, ordinal)
            if chunk is not None:
                items.append(_chunk_item(value, geometry, chunk))
        return items

    def expected_items(self) -> list[int]:
        """How many items each rank writes (rank 0 checks every rank's results against it)."""
        return [len(keys) for keys in self.written()]

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
            geometry = self.geometry(value)
            chunks = geometry.chunk_list()
            for chunk, writer in enumerate(geometry.writers(ordinal).tolist()):
                keys[writer].append(_key(value.fqn, chunks[chunk].offsets, chunk))
        self._written = keys
        return keys

    def state_dict_metadata(self) -> dict[str, STORAGE_TYPES]:
        """Every value's storage metadata, every chunk of every tensor (built once)."""
        if self._metadata is not None:
            return self._metadata
        metadata: dict[str, STORAGE_TYPES] = {}
        for value in self.values:
            if value.kind == "bytes":
                metadata[value.fqn] = BytesStorageMetadata()
                continue
            assert value.properties is not None
            size = torch.Size(value.shape)
            if value.kind == "tensor":
                chunk = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
                metadata[value.fqn] = TensorStorageMetadata(value.properties, size, [chunk])
                continue
            chunks = self.geometry(value).chunk_list()
            metadata[value.fqn] = TensorStorageMetadata(value.properties, size, chunks)
        self._metadata = metadata
        return metadata


def _value_layout(fqn: str, value: Any, meshes: dict[int, tuple[np.ndarray, str]]) -> ValueLayout:
    if isinstance(value, ShardedTensor):
        shape, properties, ranks, placements = sharded_tensor_parts(fqn, value)
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


def _chunk_item(value: ValueLayout, geometry: Geometry, chunk: int) -> WriteItem:
    assert value.properties is not None
    offsets = torch.Size(geometry.offsets[chunk].tolist())
    written = ChunkStorageMetadata(offsets, torch.Size(geometry.sizes[chunk].tolist()))
    return WriteItem(
        # The hint is the chunk's place in the metadata's list (DCP's global plan sets it).
        index=MetadataIndex(value.fqn, offsets, chunk),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=written, properties=value.properties, size=torch.Size(value.shape)
        ),
    )


def _position_chunks(value: ValueLayout) -> tuple[np.ndarray, np.ndarray]:
    """(positions, ndim) offsets and sizes of the chunk at each mesh position."""
    assert value.mesh is not None
    if value.kind == "sharded":  # the shards are the positions
        return shard_chunks(value.placements, len(value.shape))
    mesh_shape = value.mesh.shape
    positions = int(np.prod(mesh_shape))
    if not all(type(p) in (Shard, Replicate) for p in value.placements):
        return _position_chunks_by_torch(value)
    coords = np.stack(np.unravel_index(np.arange(positions), mesh_shape), axis=1)
    shape = np.array(value.shape, dtype=np.int64)
    sizes = np.tile(shape, (positions, 1))
    offsets = np.zeros((positions, len(shape)), dtype=np.int64)
    for mesh_dim, placement in enumerate(value.placements):
        if not isinstance(placement, Shard):
            continue
        dim, parts = placement.dim, mesh_shape[mesh_dim]
        start, size = chunk_rows_array(sizes[:, dim], parts, coords[:, mesh_dim])
        # An empty chunk sits at the end of the dim (torch's offset for it).
        offsets[:, dim] = np.where(size > 0, offsets[:, dim] + start, shape[dim])
        sizes[:, dim] = size
    return offsets, sizes


def _position_chunks_by_torch(value: ValueLayout) -> tuple[np.ndarray, np.ndarray]:
    """The same through torch's per-coordinate function (placements beyond Shard/Replicate)."""
    assert value.mesh is not None
    mesh_shape = tuple(value.mesh.shape)
    positions = int(np.prod(mesh_shape))
    offsets = np.zeros((positions, len(value.shape)), dtype=np.int64)
    sizes = np.zeros_like(offsets)
    for position in range(positions):
        coordinate = [int(c) for c in np.unravel_index(position, mesh_shape)]
        size, offset = chunk_at(value.shape, mesh_shape, coordinate, value.placements)
        sizes[position], offsets[position] = size, offset
    return offsets, sizes
