"""Which replica reads which saved item of a shard: HSDP's read-once split by items, not tensors.

Under HSDP the R replicas of a shard split its reading and share what they read
(``replica_reads``). Split by tensors, a replica plans every saved item of the tensors it
reads; under the even writes (``replica_shares``) a large tensor's chunk is saved as up to R
row pieces, so the replica that drew the embedding planned (and read) a thousand pieces from
a thousand files at 8,192 ranks while most replicas read nothing: one rank's plan grew with
the replicas, and so did its reads. Split by the saved items, a replica plans only the items
it reads, about 1/R of its shard's:

- an item that a rank of the set wrote is read by that rank: at the same layout that is every
  item, so each rank reads back what it wrote (the save's even writes make these reads even),
  and its plan asks for its own index only;
- the other items (a checkpoint saved at another world size or mesh) are dealt in rounds of
  at most one a replica: in each round the largest go to the replicas with the fewest bytes
  to read so far (ties: the earlier item, the earlier place). A round never widens the gap
  between the busiest and the idlest replica beyond the larger of the gap before and its
  largest item.

The replicas compute the same split alone, from what they all hold alike: the record, the
keys in the state's order, their shard and the set's ranks. A unit is an item's overlap with
the shard; each replica broadcasts the units it read to the others afterwards, so what lands
is what DCP's own load puts there. Work per key: numpy over the items its shard meets (found
from the record's rule, never listed one by one), then Python only for the replica's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.distributed.tensor import Replicate

__all__ = ["PieceSplit", "ReplicaLoads", "Units", "replica_line", "unit_boxes"]


@dataclass(slots=True)
class ReplicaLoads:
    """One replica set (the ranks along a ``Replicate`` mesh dim) and what each reads so far."""

    ranks: np.ndarray
    """(R,) the replicas' global ranks, in the mesh's order."""
    me: int
    """This rank's place in ``ranks``."""
    loads: np.ndarray = field(init=False)
    """(R,) bytes each replica reads of the keys split so far."""
    _place: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.loads = np.zeros(self.ranks.size, dtype=np.int64)
        self._place = np.full(int(self.ranks.max()) + 1, -1, dtype=np.int64)  # rank -> place
        self._place[self.ranks] = np.arange(self.ranks.size)

    def readers(self, writers: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """The place of the replica that reads each unit (the rule in the module's docstring).

        ``writers``: the global rank that wrote each unit's item; ``nbytes``: the unit's bytes.
        """
        # A writer past the set's largest rank looks up that rank's place, then fails the test.
        place = self._place[np.minimum(writers, self._place.size - 1)]
        place = np.where(self.ranks[place] == writers, place, -1)
        own = place >= 0
        self._add(place[own], nbytes[own])
        rest = np.flatnonzero(~own)
        for at in range(0, rest.size, self.ranks.size):  # at most one unit a replica a round
            batch = rest[at : at + self.ranks.size]
            batch = batch[np.argsort(-nbytes[batch], kind="stable")]  # the largest first
            least = np.argsort(self.loads, kind="stable")[: batch.size]
            place[batch] = least
            self.loads[least] += nbytes[batch]
        return place

    def _add(self, places: np.ndarray, nbytes: np.ndarray) -> None:
        """Add each unit's bytes to its replica's load (several units may share one)."""
        if places.size:
            added = np.bincount(places, weights=nbytes, minlength=self.ranks.size)
            self.loads += added.astype(np.int64)  # exact: float64 holds any byte count here


@dataclass(frozen=True, slots=True)
class Units:
    """The saved items a shard meets, as boxes of the local tensor, and who reads each."""

    offsets: np.ndarray
    """(units, ndim): where each starts in the local tensor."""
    sizes: np.ndarray
    """(units, ndim)."""
    readers: np.ndarray
    """(units,): the place (in the set's ranks) of the replica that reads it."""


@dataclass(slots=True)
class PieceSplit:
    """One key's split between its replicas: their set, and the units once found."""

    replicas: ReplicaLoads
    units: Units | None = None
    """Set by :meth:`take`; None: the key was not split (every replica reads all of it)."""

    def take(
        self, units: tuple[np.ndarray, np.ndarray, np.ndarray], writers: np.ndarray
    ) -> np.ndarray:
        """Split the units (:func:`unit_boxes`) among the replicas; which are this one's.

        ``writers``: the global rank that wrote each unit's item. Returns a mask of the units
        this replica reads.
        """
        offsets, sizes, nbytes = units
        readers = self.replicas.readers(writers, nbytes)
        self.units = Units(offsets, sizes, readers)
        mine: np.ndarray = readers == self.replicas.me
        return mine


def unit_boxes(
    box: tuple[tuple[int, ...], tuple[int, ...]],
    items: tuple[np.ndarray, np.ndarray],
    itemsize: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The overlaps of saved items ``(offsets, sizes)`` (global) with the shard ``box``.

    As (offsets within the shard, sizes, bytes), one row per item: the same for every tensor
    of one geometry, cut and dtype, so a caller computes them once for all of those.
    """
    low = np.array(box[0], dtype=np.int64)
    high = low + np.array(box[1], dtype=np.int64)
    offsets, sizes = items
    start = np.maximum(offsets, low)
    size = np.minimum(offsets + sizes, high) - start  # (items, ndim)
    return start - low, size, size.prod(axis=1) * itemsize


def replica_line(mesh: np.ndarray, placements: tuple[Any, ...], rank: int) -> np.ndarray | None:
    """The ranks along the one ``Replicate`` mesh dim (of more than one rank) through ``rank``.

    What ``replica_reads`` finds from a DTensor's device mesh, from a layout's numpy mesh
    (a benchmark's or a test's simulated rank). None where no such single dim exists.
    """
    dims = [
        d
        for d, placement in enumerate(placements)
        if isinstance(placement, Replicate) and mesh.shape[d] > 1
    ]
    where = np.argwhere(mesh == rank)
    if len(dims) != 1 or not where.size:
        return None
    index: list[Any] = [int(c) for c in where[0]]
    index[dims[0]] = slice(None)
    line: np.ndarray = mesh[tuple(index)].reshape(-1)
    return line
