"""A group's plan: everything derived from its parameters and configuration, as one value.

:func:`plan_group` computes a :class:`GroupPlan` whole: the buffers' layout, which
parameters sit in the flat buffers and which are gathered through all-gather hooks, the
post-forward slices, and every decision the copies follow (staging, one copy for the group,
a shard axis of one rank). The group holds the one plan; a re-plan (a dtype change, hooks
taken up, the hooks' sizes learnt at their first call) computes a new one and replaces it,
never a field of it. What changes as the group runs (the buffers, the slices kept after
forward, a reduction in flight) is held elsewhere and only read against the plan.
See [Note: flat group buffers] and [Note: unsharded storage].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardkit.core.engine.buffer_layout import GroupLayout, group_layout
from shardkit.core.engine.group.hooked_params import GroupHooks
from shardkit.core.engine.group.post_forward import PostForwardPlan
from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.param import FSDPParam
from shardkit.core.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shardkit.core.runtime.buffers import one_copy_numel

__all__ = ["GroupConfig", "GroupPlan", "plan_group"]


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """What a group is built from (besides its parameters)."""

    modules: tuple[nn.Module, ...]
    mesh_info: MeshInfo
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPlan:
    """One group's plan (see the module docstring); made by :func:`plan_group` alone."""

    layout: GroupLayout
    """The group's buffers, from its parameters' shapes, dtypes and hooks."""
    flat: tuple[int, ...]
    """Indices of the parameters with a slot in the flat buffers (those without hooks)."""
    hooks: GroupHooks | None
    """The parameters gathered through all-gather hooks, if any."""
    post_forward: PostForwardPlan | None
    """The slices kept after forward (``reshard_after_forward=n``), if any."""
    device: torch.device
    """The mesh's device: full parameters and collectives' buffers live there."""
    offload: bool
    """Whether the sharded parameters live on the CPU (``CPUOffloadPolicy``)."""
    pin_memory: bool
    """Whether that CPU memory is pinned."""
    needs_staging: bool
    """Whether the all-gather sends a staging copy (a cast, a move or hooks), not the shards."""
    one_copy_in: int | None
    """Elements of the one copy-in for the whole group, where the layouts line up; else None."""
    aliases_shards: bool
    """One shard rank, nothing to cast or move: the full parameters view the shards."""
    copies_shards: bool
    """One shard rank with a cast or a move: the full parameters are one copy of the shards."""
    one_local_copy: int | None
    """Elements of that copy where it is one copy for the group (the layouts line up)."""

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in (the layout's)."""
        return self.layout.reduce_dtype

    @property
    def storage_device(self) -> torch.device:
        """Where sharded parameters live: the mesh device, or the CPU when offloading."""
        return torch.device("cpu") if self.offload else self.device


def plan_group(
    params: Sequence[FSDPParam], config: GroupConfig, reshard_after_forward: bool | int
) -> GroupPlan:
    """The plan of a group of ``params`` as they are now (shapes, dtypes, hooks).

    Args:
        params: the group's parameters, in packing order.
        config: what the group is built from.
        reshard_after_forward: the group's policy now (an int keeps 1/n slices).

    Raises:
        ValueError: trainable parameters of different dtypes and no ``reduce_dtype``.
    """
    mesh_info, mp = config.mesh_info, config.mp_policy
    offload = isinstance(config.offload_policy, CPUOffloadPolicy)
    pin_memory = offload and getattr(config.offload_policy, "pin_memory", False)
    rsf = reshard_after_forward
    # One function lays out the engine's buffers and the planner's predictions alike.
    layout = group_layout(
        [p.spec for p in params],
        shard_world=mesh_info.shard_size,
        replicate_world=mesh_info.replicate_size,
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        post_forward_world=None if isinstance(rsf, bool) else rsf,
    )
    hook_device = mesh_info.device if offload else None
    hooks = GroupHooks.of(params, mesh_info.shard_mesh, mp, hook_device)
    post_forward = PostForwardPlan.of(rsf, params, layout, mesh_info)
    # One shard rank and nothing to cast or move: each shard is its full parameter, and
    # the unsharded parameters view the sharded buffer itself; unsharding runs no
    # collective and copies nothing. See [Note: unsharded storage] (one shard rank).
    one_rank = layout.shard_world == 1 and post_forward is None
    aliases_shards = one_rank and layout.unsharded_views_storage and not offload
    assert not aliases_shards or layout.unsharded == layout.storage
    return GroupPlan(
        layout=layout,
        flat=tuple(i for i, p in enumerate(params) if p.hooks is None),
        hooks=hooks,
        post_forward=post_forward,
        device=mesh_info.device,
        offload=offload,
        pin_memory=pin_memory,
        # The all-gather reads the sharded buffer itself unless it must be cast or moved,
        # or hooks give what it sends: then it sends a staging copy, borrowed from the pool.
        needs_staging=offload or layout.casts_or_hooks,
        one_copy_in=None if hooks else one_copy_numel(layout.storage, layout.comm),
        aliases_shards=aliases_shards,
        # One shard rank with a cast or a move: the shards are copied, no staging, no gather.
        copies_shards=one_rank and not aliases_shards and hooks is None,
        one_local_copy=one_copy_numel(layout.storage, layout.unsharded),
    )
