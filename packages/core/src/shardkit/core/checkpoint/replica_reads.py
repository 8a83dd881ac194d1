"""Loads that read each unique byte once: replicas split the reading and share what they read.

Under HSDP every replica holds the same shards, and DCP's load has each replica read them
from storage: R times the unique bytes in all, every rank as much as a rank of one replica
(torchtitan#4035). Here the ranks that hold the same local chunk of a DTensor (the ranks along
its one ``Replicate`` mesh dim) split its tensors between them: each reads only its part, then
broadcasts it to the other replicas over that mesh dim's group, packed into buckets (one
collective per bucket, never one per tensor).

Which replica reads which tensor every replica computes alone, from what all of them hold
alike (the keys in the state's order and the local sizes): greedy by bytes, so each reads
about 1/R. No exchange decides it. A load planned from the checkpoint's layout record splits
finer, by the saved items (``local_plan.replica_pieces``: a rank reads back what it wrote),
through :meth:`ReplicaSplitPlanner._share` and :attr:`ReplicaSet.pieces`.

A replica that fails to read must not leave the others waiting in a broadcast: after the
reads, every rank shares whether it read (one small all-gather on the world), and if any
failed, every rank raises instead of exchanging (DCP then reports every rank's error on
every rank). Values that are not DTensors, and DTensors replicated along no mesh dim or along
several, are read by every rank that holds them, as DCP reads them. Counted per rank:
:class:`ReadCounts`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.futures import Future

from shardkit.core.checkpoint.dcp_reading import SafeFileSystemReader, SafeLoadPlanner
from shardkit.core.runtime.groups import global_rank
from shardkit.core.runtime.p2p.agreement import everyone
from shardkit.core.runtime.replica_exchange import broadcast_parts

__all__ = ["PieceParts", "ReadCounts", "ReplicaSet", "ReplicaSplitPlanner", "ReplicaSplitReader"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ReadCounts:
    """What this rank's last load read from storage and received from its replicas."""

    bytes_read: int = 0
    """Bytes of the checkpoint's files this rank read (every item's stored length)."""
    items_read: int = 0
    bytes_received: int = 0
    """Bytes of tensors other replicas read and broadcast to this rank."""
    broadcasts: int = 0
    """Collectives of the exchange this rank took part in (one per bucket)."""
    tensors_skipped: int = 0
    """Tensors this rank did not read because another replica read them."""


@dataclasses.dataclass(frozen=True, slots=True)
class PieceParts:
    """Boxes of one local tensor that its replicas read apart (a split by the saved items)."""

    local: torch.Tensor
    offsets: np.ndarray
    """(units, ndim): where each box starts in ``local``."""
    sizes: np.ndarray
    readers: np.ndarray
    """(units,): the place of the replica that reads each box."""


@dataclasses.dataclass(slots=True)
class ReplicaSet:
    """The ranks along one ``Replicate`` mesh dim from this rank, and who reads what."""

    group: dist.ProcessGroup
    ranks: list[int]
    """The replicas' global ranks, in the mesh's order."""
    me: int
    """This rank's place in ``ranks``."""
    parts: list[list[torch.Tensor]]
    """Per replica, the local tensors it reads whole (its part), in the state's order."""
    loads: list[int]
    """Per replica, the bytes of the tensors given it whole so far."""
    pieces: list[PieceParts] = dataclasses.field(default_factory=list)
    """Local tensors split by boxes instead (``local_plan.replica_pieces``), in state order."""

    def all_parts(self) -> list[list[torch.Tensor]]:
        """Per replica, what it reads: its whole tensors, then its boxes (views of the locals).

        The boxes' views are made here, at the exchange, not at the plan: one per box, each
        box at least a row piece's bytes (``replica_shares.SMALLEST_PIECE``) where a chunk
        was cut, so their making costs less than their copy.
        """
        parts = [list(part) for part in self.parts]
        for split in self.pieces:
            starts, sizes = split.offsets.tolist(), split.sizes.tolist()
            for start, size, reader in zip(starts, sizes, split.readers.tolist(), strict=True):
                box = tuple(slice(a, a + n) for a, n in zip(start, size, strict=True))
                parts[reader].append(split.local[box])
        return parts


def _replicate_dim(value: DTensor) -> int | None:
    """The one mesh dim along which ``value`` is replicated on more than one rank, or None."""
    dims = [
        d
        for d, placement in enumerate(value.placements)
        if isinstance(placement, Replicate) and value.device_mesh.size(d) > 1
    ]
    return dims[0] if len(dims) == 1 else None


def _replicas_of(mesh: DeviceMesh, dim: int) -> list[int]:
    """The global ranks along ``dim`` of ``mesh`` through this rank's coordinate."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a DTensor's rank is on its mesh
    index: list[Any] = list(coordinate)
    index[dim] = slice(None)
    return [int(r) for r in mesh.mesh[tuple(index)].reshape(-1).tolist()]


class ReplicaSplitPlanner(SafeLoadPlanner):
    """DCP's load planner that reads, of each replicated DTensor, only this replica's part."""

    def __init__(self) -> None:
        super().__init__()
        self.replica_sets: list[ReplicaSet] = []
        self._others: set[str] = set()  # keys another replica reads

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Set up DCP's plan, then split the replicated DTensors between their replicas."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        sets: dict[tuple[Any, ...], ReplicaSet] = {}
        for fqn, value in self.state_dict.items():
            if not isinstance(value, DTensor):
                continue
            dim = _replicate_dim(value)
            if dim is None:
                continue
            mesh = value.device_mesh
            key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.reshape(-1).tolist()), dim)
            if key not in sets:
                ranks = _replicas_of(mesh, dim)
                sets[key] = ReplicaSet(
                    group=mesh.get_group(dim),
                    ranks=ranks,
                    me=ranks.index(global_rank()),
                    parts=[[] for _ in ranks],
                    loads=[0] * len(ranks),
                )
            # the storage DCP reads into, without autograd
            self._share(fqn, value.to_local().detach(), sets[key])
        self.replica_sets = list(sets.values())

    def _share(self, fqn: str, local: torch.Tensor, replica_set: ReplicaSet) -> None:
        """Give the key to one replica whole: the least loaded (the same on every replica)."""
        loads = replica_set.loads
        reader = loads.index(min(loads))
        loads[reader] += local.numel() * local.element_size()
        replica_set.parts[reader].append(local)
        if reader != replica_set.me:
            self._others.add(fqn)

    def create_local_plan(self) -> LoadPlan:
        """DCP's local plan, without the items other replicas read."""
        plan = super().create_local_plan()
        kept = [item for item in plan.items if item.dest_index.fqn not in self._others]
        return dataclasses.replace(plan, items=kept)

    @property
    def tensors_skipped(self) -> int:
        """How many tensors another replica reads for this rank."""
        return len(self._others)


class ReplicaSplitReader(SafeFileSystemReader):
    """DCP's file reader that, after reading, shares each replica's part with the others.

    Use with :class:`ReplicaSplitPlanner` (any other planner reads as DCP does).
    """

    def __init__(
        self, path: str | Path, metadata: Metadata | None = None, counts: ReadCounts | None = None
    ) -> None:
        super().__init__(path, metadata)
        self.counts = counts if counts is not None else ReadCounts()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items, agree that every rank did, then exchange the parts."""
        counts = self.counts
        failure: Exception | None = None
        try:
            counts.items_read = len(plan.items)
            counts.bytes_read = sum(self.storage_data[i.storage_index].length for i in plan.items)
            super().read_data(plan, planner).wait()
        except Exception as error:  # shared below before anyone exchanges
            failure = error

        def read() -> None:
            if failure is not None:
                raise RuntimeError(f"{type(failure).__name__}: {failure}")

        # Every rank, whatever its planner: the exchange's groups are the replicas', but a
        # rank that failed must stop its replicas before they wait on it in a broadcast.
        failed = [rank for rank, outcome in enumerate(everyone(read)) if outcome.failed]
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError(
                f"rank(s) {failed} failed to read their part of the checkpoint; this rank "
                "read its own, but the replicas' parts were not exchanged"
            )
        if isinstance(planner, ReplicaSplitPlanner):
            counts.tensors_skipped = planner.tensors_skipped
            counts.bytes_received, counts.broadcasts = 0, 0
            for replica_set in planner.replica_sets:
                received, broadcasts = broadcast_parts(
                    replica_set.all_parts(), replica_set.ranks, replica_set.me, replica_set.group
                )
                counts.bytes_received += received
                counts.broadcasts += broadcasts
        done: Future[None] = Future()
        done.set_result(None)
        return done
