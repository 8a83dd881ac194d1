"""The public entry point: ``fully_shard``, which adds FSDPModule's methods to a module.

Everything is validated before anything is changed, so a failed call leaves the module as it
was; what the call builds is the engine's (``engine/build.py``, shared with ``replicate``), and
how it then takes the modules over is ``adoption``'s (shared too). The classes swapped in
(``Linear`` -> ``FSDPLinear``) are made here (``replicate``'s, ``ReplicateLinear``, in
``replicate_api``) and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType
from typing import TYPE_CHECKING, Any, TypeAlias, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shardkit.core.adoption import ComposableApi, modules_of
from shardkit.core.engine.build import CallSettings, build_state
from shardkit.core.engine.fsdp_state import FSDPState
from shardkit.core.engine.mesh_info import mesh_info_for
from shardkit.core.engine.sharding import validate_reshard_after_forward
from shardkit.core.engine.spmd import spmd_mesh_info
from shardkit.core.engine.state_registry import is_managed, state_of
from shardkit.core.errors import FullyShardUsageError
from shardkit.core.fsdp_module import FSDPModule
from shardkit.core.optim.torch_muon import refuse_torch_muon_on_shards
from shardkit.core.placement import placement_resolver
from shardkit.core.policies import (
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    offload_policy_of,
)
from shardkit.core.runtime.groups import default_mesh
from shardkit.core.torch_facing.composable_registry import applied_apis
from shardkit.core.torch_facing.fsdp_classes import TorchFacing, managed_by_torch_fsdp

if TYPE_CHECKING:
    # Only for the annotation: torch releases before 2.12 have no such class, and spmd.py
    # takes any object with its two fields.
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
    from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy

__all__ = ["fully_shard", "register_fsdp_forward_method"]

logger = logging.getLogger(__name__)

_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


# Shard, None, or torch's ShardPlacementResult (a placement on a mesh of its own, torch 2.13
# on): Any, as older torch releases have no such class (``placement`` reads it).
_Placement = Callable[[nn.Parameter], Shard | Any | None] | None
# Code written for torch passes torch's class; ours has the same fields. A string, so that
# nothing evaluates torch's name where the installed torch lacks it.
_MeshDims: TypeAlias = "DataParallelMeshDims | TorchDataParallelMeshDims | None"
_Offload: TypeAlias = "OffloadPolicy | TorchOffloadPolicy"


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: _Placement = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: _Offload = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: _MeshDims = ...,
) -> FSDPModule: ...
@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: _Placement = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: _Offload = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: _MeshDims = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: _Placement = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (frozen)
    offload_policy: _Offload = OffloadPolicy(),  # noqa: B008  (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: _MeshDims = None,
) -> FSDPModule | list[FSDPModule]:
    """Shard a module's parameters across the data-parallel mesh (a drop-in for torch's).

    Args:
        module: a module, or a list of modules whose parameters form one group.
        mesh: a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh with dim names (HSDP);
            default: every rank of the default process group. With ``dp_mesh_dims``, the
            whole SPMD mesh the parameters are DTensors on.
        reshard_after_forward: True frees full parameters after forward, False keeps them,
            None means True except for the root; an int n keeps a 1/n slice.
        shard_placement_fn: returns ``Shard(dim)`` for a parameter, None for ``Shard(0)``, or
            torch's ``ShardPlacementResult(placement, mesh_info)`` to shard it on a mesh of
            its own (experts on an expert mesh): each mesh's parameters form one group.
        mp_policy: mixed precision.
        offload_policy: ``CPUOffloadPolicy()`` (ours or torch's) keeps shards and gradients
            on the CPU.
        ignored_params: parameters left alone: not sharded, not moved, not reduced.
        dp_mesh_dims: the data-parallel axes of ``mesh`` (``DataParallelMeshDims``, ours or
            torch's), when the parameters are already DTensors on the whole mesh,
            ``Replicate()`` on those axes; sharding them takes an extension (shardkit.tp).

    Returns:
        The same module(s), now also instances of ``FSDPModule``.
    """
    modules = modules_of(module)
    _check_modules(modules)
    offload_policy = offload_policy_of(offload_policy)
    mesh = mesh if mesh is not None else default_mesh()
    if dp_mesh_dims is not None:
        mesh_info = spmd_mesh_info(mesh, dp_mesh_dims)
    else:
        mesh_info = mesh_info_for(mesh)
    policy = validate_reshard_after_forward(reshard_after_forward, mesh_info)
    place = placement_resolver(shard_placement_fn, mesh_info)
    settings = CallSettings(
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=frozenset(ignored_params or ()),
        reshard_after_forward=reshard_after_forward,
        reshard_policy=policy,
    )
    state = build_state(modules, mesh_info, place, settings)
    refuse_torch_muon_on_shards(modules)  # its step on these shards would be silently wrong
    return _FULLY_SHARD.adopt(module, state)


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    for m in modules:
        name = type(m).__name__
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if is_managed(m) and "replicate" in applied_apis(m):
            # torch's fully_shard would manage nothing of it (replicate's modules are not
            # composable with it): refused, as torch's replicate refuses the other order.
            raise RuntimeError(
                f"Cannot apply `fully_shard()` on a Module already managed by `replicate` "
                f"({name}); apply fully_shard or replicate to a module, not both"
            )
        if is_managed(m):
            raise FullyShardUsageError(
                "Each distinct composable distributed API can only be applied to a module "
                "once. fully_shard has already been applied to the following module:\n"
                f"{m}\nshardkit: apply fully_shard once per module ({name})"
            )
        if _managed_by_torch_fsdp(m):
            raise ValueError(f"{name} is already managed by torch's FSDP; apply one FSDP only")
        # As torch: only a ModuleList or ModuleDict is refused for lacking a forward. Any other
        # module may hold its forward elsewhere: torch.compile's OptimizedModule sets it on the
        # instance (``fully_shard(torch.compile(block))``, torchtitan's order).
        if isinstance(m, nn.ModuleList | nn.ModuleDict) and type(m).forward is nn.Module.forward:
            raise ValueError(
                "fully_shard does not support containers that do not implement forward: "
                f"{m}\nshardkit: {name} has no forward; apply fully_shard to the modules "
                "inside it"
            )


def _managed_by_torch_fsdp(module: nn.Module) -> bool:
    # Torch's classes as captured at import: patch_torch renames torch's public names to
    # shardkit's, and our own FSDP<Cls> classes are torch FSDPModules too.
    return managed_by_torch_fsdp(module)


def _fsdp_class(cls: type[nn.Module]) -> type[nn.Module]:
    if issubclass(cls, FSDPModule):
        return cls
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        # TorchFacing makes it an instance of torch's FSDPModule too (libraries check that);
        # after FSDPModule, so every method torch's class has resolves to shardkit's.
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, TorchFacing, cls), {})
        _FSDP_CLASSES[cls] = fsdp_cls
    return fsdp_cls


_FULLY_SHARD = ComposableApi("fully_shard", FSDPModule, _fsdp_class)

# torch's fully_shard carries ``fully_shard.state(module)`` (its composable-API decorator adds
# it); code and tests written for torch read the state through it, and reach torch's private
# names on it: they get the same view as torch's own ``fully_shard.state`` gives for a shardkit
# module. See [Note: torch-facing view]. Set by name: a type checker does not let a function,
# overloaded at that, grow an attribute.
setattr(fully_shard, "state", _FULLY_SHARD.state)  # noqa: B010


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's pre/post-forward logic around ``module.<method_name>`` (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        return
    state = state_of(module)
    assert isinstance(state, FSDPState)  # the registry holds the states build made
    original = getattr(type(module), method_name)

    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(self, args, kwargs)
        out = original(self, *args, **kwargs)
        return state._post_forward(self, args, out)

    setattr(module, method_name, MethodType(wrapped, module))
