"""Resharding to a smaller world after forward (``reshard_after_forward=n``).

After forward each rank keeps 1/n of every full parameter instead of 1/W: the slice for its
position within a subgroup of n consecutive shard ranks. Backward then gathers within that
subgroup only (fewer bytes and hops, e.g. within a node), at the cost of W/n times the
sharded memory between forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence

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

__all__ = ["PostForwardShard"]


# One subgroup per set of ranks, shared by every group that uses it.
def _subgroup(mesh_info: MeshInfo, size: int) -> dist.ProcessGroup:
    parent = mesh_info.shard_group
    ranks = group_ranks(parent)
    start = (mesh_info.shard_rank // size) * size
    return subgroup_of(parent, tuple(ranks[start : start + size]))


class PostForwardShard:
    """The 1/n slices a group keeps between forward and backward."""

    @staticmethod
    def of(
        policy: bool | int, params: Sequence[FSDPParam], layout: GroupLayout, mesh_info: MeshInfo
    ) -> PostForwardShard | None:
        """The slices a group with ``reshard_after_forward=policy`` keeps (None: a bool)."""
        if isinstance(policy, bool):
            return None
        assert layout.post_forward is not None
        geometries = [p.geometry for p in params]
        shapes, dims = [g.shape for g in geometries], [g.dim for g in geometries]
        return PostForwardShard(policy, shapes, dims, layout.post_forward, mesh_info)

    def __init__(
        self,
        size: int,
        shapes: list[torch.Size],
        dims: list[int],
        layout: FlatLayout,
        mesh_info: MeshInfo,
    ) -> None:
        """``layout``: the slices' flat buffer, from the group's layout (``post_forward``)."""
        self.size = size
        self.index = mesh_info.shard_rank % size
        self.mesh_info = mesh_info
        self.geometries: list[ShardGeometry] = [
            shard_geometry(shape, dim, size) for shape, dim in zip(shapes, dims, strict=True)
        ]
        assert layout.numels == tuple(g.shard_numel for g in self.geometries)
        self.layout = layout
        self.buffer: torch.Tensor | None = None
        self._group: dist.ProcessGroup | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        """The subgroup this rank gathers with in backward (created on first use)."""
        if self._group is None:
            self._group = _subgroup(self.mesh_info, self.size)
        return self._group

    def unsharded_numel(self, index: int) -> int:
        """Elements the padded full tensor needs in this world (copy-out target size)."""
        return self.size * self.geometries[index].shard_numel

    def capture(self, full_padded: list[torch.Tensor]) -> None:
        """Keep this rank's slice of each full parameter (given as padded flat tensors)."""
        first = full_padded[0]
        buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=first.device)
        for i, (flat, geo) in enumerate(zip(full_padded, self.geometries, strict=True)):
            target = self.layout.view(buffer, i).view(geo.padded_shard_shape)
            target.copy_(_slice_of(flat, geo, self.index))
        self.buffer = buffer

    def free(self) -> None:
        """Drop the slices (after the backward gather, or when resharding fully)."""
        self.buffer = None


def _slice_of(flat: torch.Tensor, geo: ShardGeometry, index: int) -> torch.Tensor:
    """Shard ``index`` of a padded full tensor (flat, at least world * shard_numel long)."""
    if geo.dim == 0:
        return flat[: geo.world * geo.shard_numel].view(geo.world, *geo.padded_shard_shape)[index]
    return rank_major_view(flat[: geo.shape.numel()], geo)[index]
