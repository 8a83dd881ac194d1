"""A group's unsharded flat buffer, and the full parameters that view it.

The buffer's memory exists only between unshard and reshard: resharding frees it, and the
next unshard re-allocates the same storage object and fills it, from the all-gathered rows or
(on a shard axis of one rank) straight from the shards. See [Note: unsharded storage].
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shardkit.core.param import FSDPParam
from shardkit.core.runtime.buffers import (
    FlatLayout,
    RowSplit,
    ShardGeometry,
    copy_out_unsharded,
    row_split,
)

__all__ = ["UnshardedBuffer"]


@dataclass(frozen=True, slots=True)
class _RowCopy:
    """The one-copy-per-row split for one pair of layouts, and its out= views (or none)."""

    row_layout: FlatLayout
    geometries: Sequence[tuple[int, ShardGeometry]]
    layout: FlatLayout
    split: RowSplit | None
    outputs: list[list[torch.Tensor]]  # per rank: views of the buffer (and scratch)


class UnshardedBuffer:
    """The flat buffer of a group's full parameters (those not gathered through hooks)."""

    def __init__(self, params: Sequence[FSDPParam], flat: Sequence[int]) -> None:
        self._params = params
        self._flat = flat  # indices of the parameters with a slot in the flat buffers
        self.tensor: torch.Tensor | None = None
        """The buffer (uint8), once made; its storage has 0 bytes while resharded."""
        self._row_copy: _RowCopy | None = None  # views of ``tensor``: dropped with it

    def alias(self, sharded: torch.Tensor, layout: FlatLayout) -> None:
        """One shard rank, nothing to cast or move: the parameters view the shards' buffer."""
        if self.tensor is not sharded:
            self.tensor = sharded
            self._row_copy = None
            self._bind(sharded, layout)

    def allocate(self, layout: FlatLayout, device: torch.device) -> torch.Tensor:
        """The buffer with its memory, made on first use (contents undefined)."""
        buffer = self.tensor
        if buffer is None:
            buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
            self.tensor = buffer
            self._row_copy = None
            self._bind(buffer, layout)
        elif buffer.untyped_storage().nbytes() == 0:
            # See [Note: unsharded storage]: same storage object, memory re-allocated.
            buffer.untyped_storage().resize_(layout.nbytes)
        return buffer

    def free(self) -> None:
        """Give the memory back; the storage object stays for the next unshard."""
        if self.tensor is not None:
            self.tensor.untyped_storage().resize_(0)

    def forget(self) -> None:
        """Drop the buffer (new device or layout): the next unshard makes and binds another."""
        self.tensor = None
        self._row_copy = None

    def copy_out(
        self,
        rows: Sequence[torch.Tensor],
        row_layout: FlatLayout,
        geometries: Sequence[tuple[int, ShardGeometry]],
        layout: FlatLayout,
    ) -> None:
        """Write the gathered ``rows`` (one per rank, laid out by ``row_layout``) in place.

        One ``split_with_sizes_copy`` per row where the layouts allow it (see ``RowSplit``),
        else one copy per parameter and rank. ``row_layout``, ``geometries`` and ``layout``
        must be the same objects from call to call (the group's own): the split and its views
        of the buffer are made once for them.
        """
        assert self.tensor is not None
        plan = self._row_copy
        if (
            plan is None
            or plan.row_layout is not row_layout
            or plan.geometries is not geometries
            or plan.layout is not layout
        ):
            plan = self._plan_row_copy(row_layout, geometries, layout)
        if plan.split is not None and len(rows) == plan.split.world:
            plan.split.copy(rows, plan.outputs)
        else:
            self.copy_out_each(rows, row_layout, geometries, layout)

    def copy_out_each(
        self,
        rows: Sequence[torch.Tensor],
        row_layout: FlatLayout,
        geometries: Iterable[tuple[int, ShardGeometry]],
        layout: FlatLayout,
    ) -> None:
        """As :meth:`copy_out`, one copy per parameter and rank, for any layouts."""
        assert self.tensor is not None
        for i, geo in geometries:
            target = layout.view(self.tensor, i)[: geo.world * geo.shard_numel]
            copy_out_unsharded([row_layout.view(row, i) for row in rows], geo, target)

    def _plan_row_copy(
        self,
        row_layout: FlatLayout,
        geometries: Sequence[tuple[int, ShardGeometry]],
        layout: FlatLayout,
    ) -> _RowCopy:
        assert self.tensor is not None
        split = row_split(row_layout, geometries, layout)
        outputs = [] if split is None else split.outputs(self.tensor)
        self._row_copy = _RowCopy(row_layout, geometries, layout, split, outputs)
        return self._row_copy

    def copy_from_shards(
        self, sharded: torch.Tensor, storage: FlatLayout, layout: FlatLayout, non_blocking: bool
    ) -> None:
        """One shard rank: each shard is its whole parameter; cast or move it in place.

        One copy per parameter, with no all-gather input staged in between (so no collective
        either: there is nobody to send to).
        """
        assert self.tensor is not None
        for i in self._flat:
            shard = storage.view(sharded, i)
            layout.view(self.tensor, i)[: shard.numel()].copy_(shard, non_blocking=non_blocking)

    def _bind(self, buffer: torch.Tensor, layout: FlatLayout) -> None:
        storage = buffer.untyped_storage()
        for i in self._flat:
            p = self._params[i]
            # A fresh tensor set onto the storage gets its own version counter, so writing the
            # next gather through the buffer does not look like an in-place change to autograd.
            flat = torch.empty(0, dtype=p.comm_dtype, device=buffer.device)
            flat.set_(
                storage, layout.offsets[i] // p.comm_dtype.itemsize, (layout.numels[i],), (1,)
            )
            p.bind_unsharded(flat)
