"""Moving one unit's parameters between the engine's per-parameter shards and FSDP1's flat shard.

The engine cuts each parameter on dim 0 across the ranks; FSDP1 concatenates a unit's
parameters (with alignment padding) into one flat tensor and cuts *that*. Rank ``r``'s flat
shard therefore spans pieces of several parameters, most of them held by other ranks. Every
element travels at most once, in one all-to-all per unit, and only when the rank holding it
is not the rank that needs it: the pieces a rank both holds and needs are copied locally.
Both sides compute the same plan from the layout alone, so the sizes need no exchange.
See [Note: FSDP1 flat parameters] (docs/notes/010-fsdp1-checkpoints.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from shardkit.core.layout import ParamLayout
from shardkit.legacy.comm import all_to_all
from shardkit.legacy.flat_layout import FlatParamEntry, FlatParamUnit

__all__ = ["FLAT_PADDING_VALUE", "FlatExchange", "ParamSpan"]

FLAT_PADDING_VALUE = 42.0
"""What FSDP1 fills alignment padding with (a marker; no computation reads it)."""


class _Overlap(NamedTuple):
    """Elements ``[lo, hi)`` of the unsharded flat parameter, inside parameter ``param``."""

    param: int
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class ParamSpan:
    """One parameter of the unit: its place in the flat parameter and its dim-0 sharding."""

    entry: FlatParamEntry
    layout: ParamLayout
    """The engine's geometry of the parameter (sharded on dim 0)."""

    def __post_init__(self) -> None:
        assert self.layout.shard_dim == 0, (self.entry.fqn, "FSDP1 units shard on dim 0")

    def shard_start(self, rank: int) -> int:
        """Where ``rank``'s engine shard starts in the unsharded flat parameter."""
        shape = self.layout.shape
        if not shape:
            return self.entry.offset
        row = self.entry.numel // shape[0] if shape[0] else 0
        return self.entry.offset + min(rank * self.layout.chunk, shape[0]) * row

    def shard_numel(self, rank: int) -> int:
        """Elements of ``rank``'s engine shard."""
        return self.layout.local_numel(rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatExchange:
    """The all-to-all plan of one unit on one rank, both ways."""

    unit: FlatParamUnit
    spans: tuple[ParamSpan, ...]
    """One per entry of ``unit``, in its order."""
    rank: int
    """This rank's index in the unit's process group."""

    def _overlaps(self, param_rank: int, flat_rank: int) -> Iterator[_Overlap]:
        """What ``param_rank``'s engine shards hold of ``flat_rank``'s flat shard, in order."""
        start = self.unit.shard_offset(flat_rank)
        stop = start + self.unit.local_numel(flat_rank)
        for index, span in enumerate(self.spans):
            first = span.shard_start(param_rank)
            lo, hi = max(first, start), min(first + span.shard_numel(param_rank), stop)
            if lo < hi:
                yield _Overlap(index, lo, hi)

    def _sizes(self, *, held: bool) -> list[int]:
        """Elements exchanged with each other rank (0 for this one: copied locally).

        ``held``: what this rank's engine shards hold of each rank's flat shard; otherwise
        what each rank's engine shards hold of this rank's flat shard.
        """
        me = self.rank
        return [
            0
            if other == me
            else sum(o.hi - o.lo for o in self._overlaps(*((me, other) if held else (other, me))))
            for other in range(self.unit.world_size)
        ]

    def to_flat(self, shards: Sequence[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
        """This rank's FSDP1 flat shard, from every rank's engine shards (collective).

        Args:
            shards: this rank's engine shard of each parameter, in ``spans`` order.
            group: the unit's process group; every rank of it calls with its own shards.

        Returns:
            1-D, ``unit.local_numel(rank)`` elements; alignment padding holds FSDP1's marker.
        """
        me, base = self.rank, self.unit.shard_offset(self.rank)
        flats = [s.reshape(-1) for s in shards]
        dtype, device = self.unit.dtype, flats[0].device if flats else torch.device("cpu")
        out = torch.full(
            (self.unit.local_numel(me),), FLAT_PADDING_VALUE, dtype=dtype, device=device
        )
        sends = [
            flats[o.param][self._in_shard(o, me)]
            for other in range(self.unit.world_size)
            if other != me
            for o in self._overlaps(me, other)
        ]
        send = torch.cat(sends) if sends else out.new_empty(0)
        received = all_to_all(send, self._sizes(held=True), self._sizes(held=False), group)
        for o in self._overlaps(me, me):
            out[o.lo - base : o.hi - base] = flats[o.param][self._in_shard(o, me)]
        position = 0
        for other in range(self.unit.world_size):
            for o in self._overlaps(other, me) if other != me else ():
                out[o.lo - base : o.hi - base] = received[position : position + o.hi - o.lo]
                position += o.hi - o.lo
        return out

    def from_flat(self, flat: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
        """This rank's engine shards (flat), from every rank's FSDP1 flat shard (collective).

        Args:
            flat: this rank's flat shard, ``unit.local_numel(rank)`` elements.
            group: the unit's process group; every rank of it calls with its own shard.

        Returns:
            Per parameter in ``spans`` order, 1-D: its shard's elements on this rank.
        """
        me, base = self.rank, self.unit.shard_offset(self.rank)
        flat = flat.reshape(-1)
        sends = [
            flat[o.lo - base : o.hi - base]
            for other in range(self.unit.world_size)
            if other != me
            for o in self._overlaps(other, me)
        ]
        send = torch.cat(sends) if sends else flat.new_empty(0)
        received = all_to_all(send, self._sizes(held=False), self._sizes(held=True), group)
        shards = [flat.new_empty(span.shard_numel(me)) for span in self.spans]
        for o in self._overlaps(me, me):
            shards[o.param][self._in_shard(o, me)] = flat[o.lo - base : o.hi - base]
        position = 0
        for other in range(self.unit.world_size):
            for o in self._overlaps(me, other) if other != me else ():
                shards[o.param][self._in_shard(o, me)] = received[position : position + o.hi - o.lo]
                position += o.hi - o.lo
        return shards

    def _in_shard(self, overlap: _Overlap, rank: int) -> slice:
        """Where ``overlap`` lies in ``rank``'s engine shard of its parameter."""
        first = self.spans[overlap.param].shard_start(rank)
        return slice(overlap.lo - first, overlap.hi - first)
