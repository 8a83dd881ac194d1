"""What one call of ``fully_shard`` or ``replicate`` builds: its groups and its state.

Both APIs validate their own arguments and pick their mesh (``replicate``'s is replicate
only: nothing sharded, gradients all-reduced); from there the engine is the same. The
parameters are collected and validated before anything changes, so a failed call leaves the
modules as they were; then the parameters are swapped for their sharded DTensors, buffers
moved, and the state registered as managing the call's modules. The class swap and the
torch-facing view are the APIs' (``adoption``: the engine never loads ``torch_facing``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from shardkit.core.engine.fsdp_state import FSDPState
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.group.plan import GroupConfig
from shardkit.core.engine.group_options import GroupOptions
from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.sharding import (
    ManagedGroup,
    PlaceFn,
    check_hooked_params,
    collect_params,
    mark_owned,
    validate_reshard_after_forward,
)
from shardkit.core.engine.state_registry import register_state
from shardkit.core.policies import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    keeps_own_dtype,
    resolved,
)

__all__ = ["CallSettings", "build_state"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CallSettings:
    """One call's arguments as the engine takes them, validated by the API."""

    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    ignored_params: frozenset[nn.Parameter]
    reshard_after_forward: bool | int | None
    """As given: None means True, except for the root (which then keeps its parameters)."""
    reshard_policy: bool | int
    """``reshard_after_forward`` as the call's mesh took it."""


def build_state(
    modules: tuple[nn.Module, ...], mesh_info: MeshInfo, place: PlaceFn, settings: CallSettings
) -> FSDPState:
    """Shard (or replicate) the parameters in ``modules``' trees; the state that manages them.

    Raises (before anything changes): what ``collect_params`` and ``check_hooked_params``
    raise for parameters the call cannot take.
    """
    managed = collect_params(modules, set(settings.ignored_params), place, mesh_info)
    name = type(modules[0]).__name__
    policy = settings.reshard_policy
    check_hooked_params([p for m in managed for p in m.params], policy, name)
    for p in (p for m in managed for p in m.params):  # once, on the parameters as given
        original = p.original_ref()
        assert original is not None, "the call holds the module, which holds the parameter"
        p.keeps_own_dtype = keeps_own_dtype(settings.mp_policy, original, p.fqn)
    groups = tuple(
        _build_group(m, modules, settings, _options(m, mesh_info, settings)) for m in managed
    )
    # Nothing above changed the modules; from here on it cannot fail on user input.
    _move_buffers(modules, mesh_info)
    for group in groups:
        for p in group.params:
            p.register(unsharded=False)
        mark_owned(group.params, name)
    # As torch's state: the per-parameter function has been applied; inputs use param_dtype.
    state = FSDPState(modules, groups, resolved(settings.mp_policy), mesh_info.device)
    for m in modules:
        register_state(m, state)
    return state


def _build_group(
    managed: ManagedGroup,
    modules: tuple[nn.Module, ...],
    settings: CallSettings,
    options: GroupOptions,
) -> FSDPParamGroup:
    config = GroupConfig(modules, managed.mesh_info, settings.mp_policy, settings.offload_policy)
    return FSDPParamGroup(managed.params, config, options)


def _options(managed: ManagedGroup, mesh_info: MeshInfo, settings: CallSettings) -> GroupOptions:
    """A group's own runtime switches, from the call's ``reshard_after_forward``.

    A group on a mesh of its own (``shard_placement_fn``) checks an int against its own shard
    size.
    """
    given, policy = settings.reshard_after_forward, settings.reshard_policy
    if managed.mesh_info is not mesh_info:
        policy = validate_reshard_after_forward(given, managed.mesh_info)
    return GroupOptions(
        reshard_after_forward=policy, reshard_after_forward_is_default=given is None
    )


def _move_buffers(modules: Iterable[nn.Module], mesh_info: MeshInfo) -> None:
    device = mesh_info.device
    for m in modules:
        for sub in m.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta and buf.device != device:
                    sub._buffers[name] = buf.to(device)
