"""Resharding to a smaller world after forward (``reshard_after_forward=n``).

After forward each rank keeps 1/n of every full parameter instead of 1/W: the slice for its
position within a subgroup of n consecutive shard ranks. Backward then gathers within that
subgroup only (fewer bytes and hops, e.g. within a node), at the cost of W/n times the
sharded memory between forward and backward.

:class:`PostForwardPlan` is the pure part, planned with the rest of the group
(``plan``); the slices themselves are a buffer the group holds from its
``reshard_post_forward`` to the backward all-gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.engine.buffer_layout import GroupLayout
from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.buffers import (
    FlatLayout,
    ShardGeometry,
    rank_major_view,
    shard_geometry,
)
from shardkit.core.runtime.groups import group_ranks, subgroup_of

__all__ = ["PostForwardPlan"]


@dataclass(frozen=True, slots=True)
class PostForwardPlan:
    """Where the 1/n slices a group keeps between forward and backward come from and go."""

    size: int
    """n: ranks of the subgroup the slices are gathered within."""
    index: int
    """This rank's position in its subgroup: which slice it keeps."""
    geometries: tuple[ShardGeometry, ...]
    """Each parameter cut into n shards."""
    layout: FlatLayout
    """The slices' flat buffer, from the group's layout (``post_forward``)."""
    mesh_info: MeshInfo

    @staticmethod
    def of(
        policy: bool | int, params: Sequence[FSDPParam], layout: GroupLayout, mesh_info: MeshInfo
    ) -> PostForwardPlan | None:
        """The slices a group with ``reshard_after_forward=policy`` keeps (None: a bool)."""
        if isinstance(policy, bool):
            return None
        assert layout.post_forward is not None
        geometries = tuple(shard_geometry(p.geometry.shape, p.geometry.dim, policy) for p in params)
        assert layout.post_forward.numels == tuple(g.shard_numel for g in geometries)
        index = mesh_info.shard_rank % policy
        return PostForwardPlan(policy, index, geometries, layout.post_forward, mesh_info)

    def subgroup(self) -> dist.ProcessGroup:
        """The subgroup this rank gathers with in backward (created on first use, shared)."""
        parent = self.mesh_info.shard_group
        ranks = group_ranks(parent)
        start = (self.mesh_info.shard_rank // self.size) * self.size
        return subgroup_of(parent, tuple(ranks[start : start + self.size]))

    def slices_of(self, full_padded: list[torch.Tensor]) -> torch.Tensor:
        """This rank's slice of each full parameter (padded flat tensors), in a new buffer."""
        first = full_padded[0]
        buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=first.device)
        for i, (flat, geo) in enumerate(zip(full_padded, self.geometries, strict=True)):
            target = self.layout.view(buffer, i).view(geo.padded_shard_shape)
            target.copy_(_slice_of(flat, geo, self.index))
        return buffer


def _slice_of(flat: torch.Tensor, geo: ShardGeometry, index: int) -> torch.Tensor:
    """Shard ``index`` of a padded full tensor (flat, at least world * shard_numel long)."""
    if geo.dim == 0:
        return flat[: geo.world * geo.shard_numel].view(geo.world, *geo.padded_shard_shape)[index]
    return rank_major_view(flat[: geo.shape.numel()], geo)[index]
