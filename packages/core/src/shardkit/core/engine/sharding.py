"""Choosing what a ``fully_shard`` call manages, and validating it before anything changes."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.param import FSDPParam, ParamSlot, Sharding
from shardkit.core.engine.spmd import check_spmd_param, spmd_sharding
from shardkit.core.engine.state_registry import is_managed
from shardkit.core.errors import (
    InvalidShardDimError,
    UnevenShardingError,
    UnsupportedWithHooksError,
)
from shardkit.core.extensions import extension_for

__all__ = [
    "ManagedGroup",
    "Placed",
    "PlaceFn",
    "check_hooked_params",
    "collect_params",
    "mark_owned",
    "validate_reshard_after_forward",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placed:
    """Where ``shard_placement_fn`` puts one parameter: a tensor dim on a mesh."""

    dim: int | None
    """The dim to shard (may be negative); None: dim 0."""
    mesh_info: MeshInfo
    """The mesh: the call's own, or one the function returned (``ShardPlacementResult``).
    One object per mesh: parameters on the same process groups must share it."""


PlaceFn = Callable[[nn.Parameter, str], Placed]
"""``shard_placement_fn`` resolved (``shardkit.core.placement``): a parameter and its name in."""


@dataclass(frozen=True, slots=True)
class ManagedGroup:
    """The parameters of one call that share a mesh: they become one parameter group."""

    mesh_info: MeshInfo
    params: list[FSDPParam]


# Sharded parameters already owned by a group, with that group's description, so that a
# parameter shared across two fully_shard calls is caught with both names.
# Original parameters that a call sharded, keyed by identity (tensors compare elementwise):
# another module that still holds one shares it with that group, which is an error.
_ORIGINAL_OWNER = WeakIdKeyDictionary()
# Sharded parameters by id. No weakref may point at them: swap_tensors (used by to_empty and
# .to() on DTensor parameters) refuses tensors with weakrefs. The FSDPParam is checked by
# identity, so a reused id cannot be mistaken for ownership.
_SHARDED_OWNER: dict[int, tuple[weakref.ref[FSDPParam], str]] = {}


def _owner_of(param: nn.Parameter) -> str | None:
    entry = _SHARDED_OWNER.get(id(param))
    if entry is not None:
        fsdp_param = entry[0]()
        if fsdp_param is not None and fsdp_param.sharded_param is param:
            return entry[1]
    owner: str | None = _ORIGINAL_OWNER.get(param)
    return owner


def validate_reshard_after_forward(value: bool | int | None, mesh_info: MeshInfo) -> bool | int:
    """Resolve ``reshard_after_forward`` (None means True; the root later overrides it)."""
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")
    if mesh_info.spmd is not None:
        if mesh_info.has_shard_axis:
            raise NotImplementedError(
                "reshard_after_forward as int is not yet supported with SPMD mesh "
                f"(dp_mesh_dims); pass True or False (got {value})"
            )
        return False  # replicate only: nothing is sharded, as torch treats it
    size = mesh_info.shard_size
    if value < 1 or size % value != 0:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group size {size} "
            "(an int n keeps 1/n of the parameters after forward)"
        )
    if value == 1:
        logger.warning("reshard_after_forward=1 keeps full parameters: same as False")
        return False
    if value == size:
        return True
    return value


def check_hooked_params(
    managed: list[FSDPParam], reshard_after_forward: bool | int, module_name: str
) -> None:
    """Refuse what parameters with all-gather hooks cannot do, before anything changes.

    Raises:
        UnsupportedWithHooksError: ``reshard_after_forward`` is an int (n < world size).
    """
    hooked = [p.fqn for p in managed if p.hooks is not None]
    if hooked and not isinstance(reshard_after_forward, bool):
        # torch's fully_shard fails too: an AssertionError after forward (several hook
        # tensors) or a NotImplementedError in backward's gather (one).
        raise UnsupportedWithHooksError(
            f"reshard_after_forward={reshard_after_forward} is not supported for parameters "
            f"with all-gather hooks (fsdp_pre_all_gather / fsdp_post_all_gather): "
            f"fully_shard({module_name}) manages {hooked}, and torch's fully_shard cannot "
            "reshard them to a smaller world either; pass True or False for this module"
        )


def collect_params(
    modules: tuple[nn.Module, ...],
    ignored: set[nn.Parameter],
    place: PlaceFn,
    mesh_info: MeshInfo,
) -> list[ManagedGroup]:
    """The parameters this call shards, by mesh, validated; raises before anything changes.

    Those are the parameters in the modules' trees, minus already-sharded submodules and
    ignored parameters. ``mesh_info`` is the call's mesh; ``place`` may put a parameter on
    another (experts on their own mesh), and each mesh's parameters form one group, in the
    order their first parameter comes (torch's order). See [Note: per-parameter meshes].
    """
    slots: dict[int, list[ParamSlot]] = {}
    params: dict[int, nn.Parameter] = {}
    names: dict[int, str] = {}
    for index, root in enumerate(modules):
        prefix = f"[{index}]." if len(modules) > 1 else ""
        for mod_name, module in _unmanaged_modules(root):
            for name, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                key = id(param)
                if key not in params:
                    params[key] = param
                    names[key] = f"{prefix}{mod_name}{'.' if mod_name else ''}{name}"
                slots.setdefault(key, []).append(ParamSlot(module, name))
    _check_params(params, names, mesh_info)
    groups: dict[tuple[object, object], ManagedGroup] = {}
    for key, param in params.items():
        placed = place(param, names[key])
        info = placed.mesh_info
        dim = _shard_dim(param, names[key], placed.dim)
        group = groups.setdefault((info.shard_group, info.replicate_group), ManagedGroup(info, []))
        if group.mesh_info is not info:
            # As torch: which of two descriptions of one mesh would hold would be a guess.
            raise ValueError(
                f"shard_placement_fn put {names[key]} and {group.params[0].fqn} on the same "
                "process groups through different mesh_info objects; parameters sharing a "
                "mesh must share one FSDPMeshInfo object"
            )
        sharding = _sharding_of(param, names[key], dim, info)
        group.params.append(FSDPParam(param, names[key], tuple(slots[key]), sharding, info))
    return list(groups.values())


def _sharding_of(param: nn.Parameter, name: str, dim: int, mesh_info: MeshInfo) -> Sharding:
    """The extension that shards ``param`` on ``dim`` and its description, validated."""
    extension = extension_for(param, name)
    if mesh_info.spmd is not None:
        sharding = spmd_sharding(extension, param, name, dim, mesh_info.spmd)
    else:
        try:
            spec = extension.param_spec(
                param,
                shard_dim=dim,
                dp_mesh=mesh_info.mesh,
                dp_placements=mesh_info.placements(dim),
            )
        except ValueError as error:
            # The extension knows the tensor, not its name: say which parameter it refused.
            raise ValueError(f"fully_shard cannot shard parameter {name}: {error}") from error
        sharding = Sharding(extension, spec)
    spec = sharding.spec
    size = spec.local.shape[dim]
    if dim != 0 and size % mesh_info.shard_size != 0:
        raise UnevenShardingError(
            f"FSDP does not support uneven sharding on dim {dim}: {spec.local.shape} "
            f"(world size: {mesh_info.shard_size}). Shard({dim}) of {name} needs its size "
            f"{size} along dim {dim} to be divisible by the shard group size (dim 0 may be "
            "uneven)"
        )
    return sharding


def mark_owned(managed: list[FSDPParam], group_name: str) -> None:
    """Remember the sharded parameters of a successful call (for the shared-param check)."""
    for key in [k for k, (ref, _) in _SHARDED_OWNER.items() if ref() is None]:
        del _SHARDED_OWNER[key]  # groups that were garbage collected
    for fsdp_param in managed:
        owner = f"{group_name}.{fsdp_param.fqn}"
        _SHARDED_OWNER[id(fsdp_param.sharded_param)] = (weakref.ref(fsdp_param), owner)
        original = fsdp_param.original_ref()
        if original is not None:
            _ORIGINAL_OWNER[original] = owner


def _unmanaged_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules under ``root`` (itself included) not inside an already-sharded submodule."""
    found: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        name, module = stack.pop()
        found.append((name, module))
        for child_name, child in reversed(list(module.named_children())):
            if is_managed(child):
                continue
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    return found


def _check_params(
    params: dict[int, nn.Parameter], names: dict[int, str], mesh_info: MeshInfo
) -> None:
    devices: dict[torch.device, str] = {}
    for key, param in params.items():
        name = names[key]
        owner = _owner_of(param)
        if owner is not None:
            # torch's first line (2.13 on, which finds it at the first forward), then ours.
            raise ValueError(
                f"Parameter '{name}' is shared with a parameter already managed by another "
                "FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) "
                f"to place them in the same FSDP group. (shardkit: it is sharded by {owner}; "
                "refused at this fully_shard call, before anything is sharded)"
            )
        if mesh_info.spmd is not None:
            check_spmd_param(param, name, mesh_info.spmd)
        extension_for(param, name)  # a DTensor that nothing handles fails here
        if param.dim() == 0:
            raise ValueError(
                "fully_shard doesn't support scalar parameters. Change "
                f"{name} to a 1D tensor with numel equal to 1. Or pass it in ignored_params."
            )
        devices.setdefault(param.device, name)
    if len(devices) > 1:
        listed = ", ".join(f"{name} on {device}" for device, name in devices.items())
        raise ValueError(f"fully_shard needs every parameter on one device, found {listed}")


def _shard_dim(param: nn.Parameter, name: str, dim: int | None) -> int:
    if dim is None:
        return 0
    if not -param.dim() <= dim < param.dim():
        raise InvalidShardDimError(
            f"Shard dim {dim} is invalid for {param.dim()}D tensor: {param.shape} "
            f"(shard_placement_fn returned Shard({dim}) for {name})"
        )
    return dim % param.dim()
