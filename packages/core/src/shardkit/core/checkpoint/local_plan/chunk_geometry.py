"""A value's layout (:class:`ValueLayout`), its distinct chunks and who holds each.

A DTensor's chunks are a pure function of its global shape, its mesh and its placements:
torch.chunk's arithmetic per mesh dim (``Shard`` and ``Replicate``, vectorized over the
positions; any other placement, ``_StridedShard`` among them, through torch's own
per-coordinate function), grouped into distinct chunks (DCP's key: the offsets). A
:class:`Geometry` is that computation for one (shape, mesh, placements); ``chunk_writers``
decides who writes each chunk, ``replica_shares`` how its holders share it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
from torch.distributed.tensor import Replicate, Shard

from shardkit.core.checkpoint.local_plan.replica_shares import Demand, Pieces, cut_chunks
from shardkit.core.checkpoint.local_plan.sharded_tensor_chunks import shard_chunks
from shardkit.core.runtime.chunks import chunk_rows_array
from shardkit.core.runtime.dtensors import chunk_at

__all__ = ["Geometry", "ValueLayout", "mesh_key"]


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
    turn_of: np.ndarray
    """Mesh position -> its turn: its place among its chunk's holders."""
    elements: np.ndarray
    """Each chunk's elements."""
    listed: list[ChunkStorageMetadata] = field(default_factory=list)
    """The chunks as the metadata lists them (built on first use, then shared)."""
    demand: dict[int, list[Demand]] = field(default_factory=dict)
    cut: dict[tuple[tuple[int, int], ...], tuple[Pieces, list[ChunkStorageMetadata]]] = field(
        default_factory=dict
    )
    """Per cut ((holders, pieces) pairs): the pieces and their listing (built once each)."""
    cut_only: dict[tuple[tuple[int, int], ...], Pieces] = field(default_factory=dict)
    """Per cut: the pieces alone (a load lists only the few items its shards touch)."""
    listed_items: dict[tuple[tuple[int, int], ...], dict[int, ChunkStorageMetadata]] = field(
        default_factory=dict
    )
    """Per cut, per item: the item as the metadata lists it, made where a load touches it."""

    @staticmethod
    def of(value: ValueLayout, positions: dict[str, dict[int, int]] | None = None) -> Geometry:
        """The geometry of a DTensor's layout.

        ``positions``: each mesh's rank -> position map, by mesh id, shared by the
        geometries of one mesh (a dict of W entries each is worth building once).
        """
        assert value.mesh is not None
        offsets, sizes = _position_chunks(value)
        distinct, first_seen, group_of, counts = _distinct_rows(offsets, value.shape)
        holders = np.argsort(group_of, kind="stable")
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        ranks = value.mesh.reshape(-1)
        turn_of = np.empty_like(group_of)
        turn_of[holders] = np.arange(holders.size) - first[group_of[holders]]
        chunk_sizes = sizes[first_seen]
        known = {} if positions is None else positions
        position_of = known.get(value.mesh_id) if value.mesh_id else None
        if position_of is None:
            position_of = {int(r): p for p, r in enumerate(ranks.tolist())}
            if value.mesh_id:
                known[value.mesh_id] = position_of
        return Geometry(
            offsets=distinct,
            sizes=chunk_sizes,
            group_of=group_of,
            holders=holders,
            first=first,
            counts=counts,
            ranks=ranks,
            position_of=position_of,
            turn_of=turn_of,
            elements=chunk_sizes.prod(axis=1),
        )

    def demands(self, itemsize: int) -> list[Demand]:
        """Per holder count, its largest chunk's bytes and rows (what the sharing rule needs)."""
        found = self.demand.get(itemsize)
        if found is None:
            found = []
            for holders in np.unique(self.counts).tolist():
                of_count = np.flatnonzero(self.counts == holders)
                largest = int(of_count[np.argmax(self.elements[of_count])])
                rows = int(self.sizes[largest, 0]) if self.sizes.shape[1] else 0
                nbytes = int(self.elements[largest]) * itemsize
                found.append(Demand(int(holders), nbytes, rows))
            self.demand[itemsize] = found
        return found

    def pieces(
        self, cuts: tuple[tuple[int, int], ...]
    ) -> tuple[Pieces, list[ChunkStorageMetadata]]:
        """The chunks cut as ``cuts`` says ((holders, pieces) pairs), and their listing."""
        found = self.cut.get(cuts)
        if found is None:
            pieces = self.cut_pieces(cuts)
            listed = (
                self.chunk_list()
                if not cuts
                else [
                    ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                    for o, s in zip(pieces.offsets.tolist(), pieces.sizes.tolist(), strict=True)
                ]
            )
            found = self.cut[cuts] = (pieces, listed)
        return found

    def cut_pieces(self, cuts: tuple[tuple[int, int], ...]) -> Pieces:
        """The chunks cut as ``cuts`` says, without their listing (:meth:`pieces`)."""
        found = self.cut_only.get(cuts)
        if found is None:
            found = self.cut_only[cuts] = cut_chunks(
                self.offsets, self.sizes, self.counts, dict(cuts)
            )
        return found

    def listed_items_of(
        self, cuts: tuple[tuple[int, int], ...], items: list[int]
    ) -> list[ChunkStorageMetadata]:
        """``items`` of the cut, as :meth:`pieces` lists them, each made once where touched.

        A load touches a few items of a geometry; listing all of them (one per chunk or piece:
        tens of thousands at thousands of ranks) cost a rank's plan most of its time.
        """
        made = self.listed_items.setdefault(cuts, {})
        missing = [item for item in items if item not in made]
        if missing:
            pieces = self.cut_pieces(cuts)
            offsets, sizes = pieces.offsets[missing].tolist(), pieces.sizes[missing].tolist()
            for item, o, s in zip(missing, offsets, sizes, strict=True):
                made[item] = ChunkStorageMetadata(torch.Size(o), torch.Size(s))
        return [made[item] for item in items]

    def chunk_list(self) -> list[ChunkStorageMetadata]:
        """Every chunk, as the metadata lists them (one list, shared by the tensors)."""
        if not self.listed:
            self.listed = [
                ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                for o, s in zip(self.offsets.tolist(), self.sizes.tolist(), strict=True)
            ]
        return self.listed


def _distinct_rows(
    offsets: np.ndarray, shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(offsets, axis=0)``'s rows, first places, inverse and counts.

    Each row (an offset is at most its dim's size) as one number in the dims' mixed radix:
    their order is the rows' order, and a 1-D unique is several times faster than the rows'
    (W rows per geometry, on every rank at every load). Rows outside that (a damaged
    record's shards, which its reader refuses later) take the rows' unique.
    """
    radix = np.array(shape, dtype=np.int64) + 1
    beyond = offsets.size > 0 and bool(((offsets < 0) | (offsets >= radix)).any())
    if beyond or offsets.shape[1] == 0 or float(np.prod(radix.astype(np.float64))) >= 2.0**62:
        found = np.unique(
            offsets, axis=0, return_index=True, return_inverse=True, return_counts=True
        )
        return found[0], found[1], found[2].reshape(-1), found[3]
    keys = np.ravel_multi_index(tuple(offsets.T), tuple(radix.tolist()))
    _, first_seen, group_of, counts = np.unique(
        keys, return_index=True, return_inverse=True, return_counts=True
    )
    return offsets[first_seen], first_seen, group_of.reshape(-1), counts


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
