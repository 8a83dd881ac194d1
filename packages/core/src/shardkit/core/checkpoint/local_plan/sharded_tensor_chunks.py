"""FSDP1's ShardedTensors in a save planned by each rank alone.

FSDP1's SHARDED_STATE_DICT (torch's and ``shardkit.legacy``'s, without a device mesh) gives
each parameter as a ShardedTensor: every rank holds its own shard, and every rank holds the
metadata of all of them (each shard's offsets, sizes and the rank it is placed on). So, as
for a DTensor, every rank can tell who writes which chunk without asking: each shard is
written by the rank it is placed on, and the checkpoint's metadata lists the shards as DCP
lists them (one chunk per shard, the tensor's properties and size).

The shards become a :class:`chunk_writers.ValueLayout` of kind ``"sharded"``: its ``mesh`` is
the global rank of each shard, in shard order, and its ``placements`` hold the shards'
offsets and sizes (:class:`Shards`), so that the layout's digest and its geometries cover
them. A ShardedTensor whose shards cannot be placed with certainty (two shards on one rank,
a shard without a rank, shards that are ShardedTensors themselves) is not planned here:
:class:`UnplannableValue` sends the save through DCP's own planning.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.metadata import TensorProperties

from shardkit.core.runtime.groups import group_ranks

__all__ = [
    "ShardedParts",
    "Shards",
    "UnplannableValue",
    "shard_chunks",
    "sharded_tensor_parts",
]


class UnplannableValue(ValueError):
    """A value whose chunks no rank can place alone (the save goes through DCP's planning)."""


class Shards:
    """A ShardedTensor's shards: offsets and sizes, (shards, ndim) int64 arrays, and a key.

    The key, a hash of their bytes, is what the layout's digest and the geometries' keys see
    (its ``repr``, equality and hash), so that a save does not format or compare W shards of
    text per tensor: at 8,192 ranks that took seconds per save for an 8B model.
    """

    __slots__ = ("key", "offsets", "sizes")

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.offsets, self.sizes = offsets, sizes
        digest = hashlib.sha256(f"{offsets.shape}".encode())
        digest.update(offsets.tobytes())
        digest.update(sizes.tobytes())
        self.key = "shards:" + digest.hexdigest()[:32]

    def __repr__(self) -> str:
        return self.key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shards) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def sharded_tensor_parts(
    fqn: str, value: ShardedTensor
) -> tuple[tuple[int, ...], TensorProperties, np.ndarray, tuple[Any, ...]]:
    """(global shape, properties, each shard's global rank, the shards' placements).

    The placements are one :class:`Shards` (what :func:`shard_chunks` reads back).

    Raises:
        UnplannableValue: a shard has no rank, or a rank holds two shards.
    """
    if any(isinstance(shard.tensor, ShardedTensor) for shard in value.local_shards()):
        raise UnplannableValue(f"{fqn}: a ShardedTensor of ShardedTensors (FSDP1's 2D form)")
    metadata = value.metadata()
    members = group_ranks(value._process_group)  # the shards' ranks are ranks of this group
    ndim = len(metadata.size)
    count = len(metadata.shards_metadata)
    ranks = np.empty(count, dtype=np.int64)
    offsets = np.empty((count, ndim), dtype=np.int64)
    sizes = np.empty((count, ndim), dtype=np.int64)
    for i, shard in enumerate(metadata.shards_metadata):  # one pass: W shards a tensor
        rank = None if shard.placement is None else shard.placement.rank()
        if rank is None:
            raise UnplannableValue(f"{fqn}: a shard has no rank")
        ranks[i] = members[rank]
        offsets[i], sizes[i] = shard.shard_offsets, shard.shard_sizes
    if len(np.unique(ranks)) != count:
        raise UnplannableValue(f"{fqn}: a rank holds several shards")
    held = metadata.tensor_properties
    properties = TensorProperties(
        dtype=held.dtype,
        layout=held.layout,
        requires_grad=held.requires_grad,
        memory_format=held.memory_format,
        pin_memory=held.pin_memory,
    )
    return tuple(metadata.size), properties, ranks, (Shards(offsets, sizes),)


Parts = tuple[tuple[int, ...], TensorProperties, np.ndarray, tuple[Any, ...]]
"""What :func:`sharded_tensor_parts` returns."""


class ShardedParts:
    """:func:`sharded_tensor_parts`, read once per layout rather than at every save.

    A rank reads a ShardedTensor's W shards in Python (20 to 45 ms a tensor at 8,192 shards),
    and FSDP1 builds new ShardedTensors at every ``state_dict()``, so the parts are kept per
    key and reused while the tensor's key stays: its global size, properties, process group,
    number of shards, and this rank's own shards (their offsets and sizes), all O(1) to read.
    Each shard lies on its own rank, so the shards are the union of the ranks' own: a layout
    that changed changes some rank's own shards. That rank reads the shards again, and its
    layout's digest then differs from a rank that did not: rank 0 finds it and the save goes
    through DCP's own planning (``save``), never with a stale layout.
    """

    def __init__(self) -> None:
        self._parts: dict[str, tuple[tuple[Any, ...], Parts]] = {}

    def parts(self, fqn: str, value: ShardedTensor) -> Parts:
        """``value``'s parts, from the last save's where its key is the same."""
        key = _key(value)
        found = self._parts.get(fqn)
        if found is not None and found[0] == key:
            return found[1]
        parts = sharded_tensor_parts(fqn, value)
        self._parts[fqn] = (key, parts)
        return parts


def _key(value: ShardedTensor) -> tuple[Any, ...]:
    metadata = value.metadata()
    props = metadata.tensor_properties
    own = tuple(
        (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
        for s in value.local_shards()
    )
    properties = (props.dtype, props.layout, props.requires_grad, props.pin_memory)
    # The group object itself: the shards' ranks are its ranks (compared by identity).
    return (
        tuple(metadata.size),
        properties,
        len(metadata.shards_metadata),
        own,
        value._process_group,
    )


def shard_chunks(placements: tuple[Any, ...], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """(shards, ndim) offsets and sizes, from :func:`sharded_tensor_parts`'s placements."""
    shards = placements[0]
    assert isinstance(shards, Shards)
    return shards.offsets.reshape(-1, ndim), shards.sizes.reshape(-1, ndim)
