"""``replicate``: every parameter whole on every rank, gradients all-reduced (DDP), on our engine.

A drop-in for torch's ``torch.distributed._composable.replicate_with_fsdp.replicate`` (the
DDP that torchtitan applies): same signature, same checks and messages, same numerics. It is
``fully_shard``'s engine with a replicate-only mesh: each parameter becomes a ``Replicate()``
DTensor on the 1-D mesh, holding the whole tensor; forward gathers nothing; backward packs
the group's gradients into one flat buffer and all-reduces it over the mesh (HSDP's replicate
step, with a shard group of one). Mixed precision, gradient accumulation, the all-reduce
hook, offload and the state dict work as they do for ``fully_shard``, and ``replicate`` and
``fully_shard`` modules mix in one model: each leaves the other's modules out.

The module's class becomes ``Replicate<Cls>``, an instance of shardkit's ``ReplicateModule``
(an ``FSDPModule``) and of torch's ``ReplicateModule`` and ``FSDPModule``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.core.adoption import ComposableApi, modules_of
from shardkit.core.engine.build import CallSettings, build_state
from shardkit.core.engine.mesh_info import replicate_mesh_info
from shardkit.core.engine.spmd import spmd_mesh_info
from shardkit.core.errors import FullyShardUsageError
from shardkit.core.fsdp_module import FSDPModule
from shardkit.core.placement import placement_resolver
from shardkit.core.policies import MixedPrecisionPolicy, OffloadPolicy, offload_policy_of
from shardkit.core.runtime.groups import default_mesh
from shardkit.core.torch_facing.composable_registry import applied_apis
from shardkit.core.torch_facing.fsdp_classes import TorchReplicateFacing, managed_by_torch_fsdp

if TYPE_CHECKING:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
    from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy

    from shardkit.core.policies import DataParallelMeshDims

__all__ = ["ReplicateModule", "is_composable_with_replicate", "replicate"]

_REPLICATE_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}

_MeshDims: TypeAlias = "DataParallelMeshDims | TorchDataParallelMeshDims | None"
_Offload: TypeAlias = "OffloadPolicy | TorchOffloadPolicy"


class ReplicateModule(FSDPModule):
    """A module ``replicate`` manages: ``FSDPModule``'s methods, nothing sharded.

    ``Replicate<Cls>`` classes derive from it, then from torch's ``ReplicateModule`` (through
    the torch-facing base), then from the module's own class.
    """


@overload
def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: _Offload = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: _MeshDims = ...,
) -> ReplicateModule: ...
@overload
def replicate(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: _Offload = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: _MeshDims = ...,
) -> list[ReplicateModule]: ...


def replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (frozen)
    offload_policy: _Offload = OffloadPolicy(),  # noqa: B008  (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: _MeshDims = None,
) -> ReplicateModule | list[ReplicateModule]:
    """Replicate a module's parameters on every rank of a mesh; all-reduce their gradients.

    Args:
        module: a module, or a list of modules whose parameters form one group.
        mesh: a 1-D mesh; default: every rank of the default process group, its axis named
            ``"replicate"``. With ``dp_mesh_dims``, the whole SPMD mesh the parameters are
            DTensors on.
        mp_policy: mixed precision (parameters cast for forward and backward, gradients
            reduced in ``reduce_dtype``).
        offload_policy: ``CPUOffloadPolicy()`` (ours or torch's) keeps the parameters and
            gradients on the CPU.
        ignored_params: parameters left alone: not replicated, not moved, not reduced.
        dp_mesh_dims: the data-parallel axes of ``mesh`` (``DataParallelMeshDims``, ours or
            torch's) when the parameters are already DTensors on the whole mesh; replicate
            axes only.

    Returns:
        The same module(s), now also instances of ``ReplicateModule`` (an ``FSDPModule``).

    Raises:
        RuntimeError: ``fully_shard`` already manages the module.
        FullyShardUsageError: ``replicate`` already manages it (an ``AssertionError`` too,
            as torch's).
        ValueError: a container without ``forward``, a mesh that is not 1-D, ``dp_mesh_dims``
            naming a shard axis, or a module torch's own FSDP manages.
    """
    modules = modules_of(module)
    _check_modules(modules)
    offload_policy = offload_policy_of(offload_policy)
    mesh = mesh if mesh is not None else default_mesh("replicate")
    if dp_mesh_dims is not None:
        mesh_info = spmd_mesh_info(mesh, dp_mesh_dims)
        if mesh_info.has_shard_axis:
            raise ValueError(
                "replicate() with dp_mesh_dims requires replicate-only dims (no shard dims). "
                f"Use fully_shard() for sharding. (dp_mesh_dims names {dp_mesh_dims})"
            )
    else:
        mesh_info = replicate_mesh_info(mesh)
    settings = CallSettings(
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=frozenset(ignored_params or ()),
        # Nothing is sharded, so nothing is resharded after forward (torch's replicate has
        # no post-forward mesh either).
        reshard_after_forward=False,
        reshard_policy=False,
    )
    state = build_state(modules, mesh_info, placement_resolver(None, mesh_info), settings)
    return _REPLICATE.adopt(module, state)


def is_composable_with_replicate(module: nn.Module) -> bool:
    """Whether ``replicate`` may manage ``module``: no ``fully_shard`` (ours or torch's) does."""
    return "fully_shard" not in applied_apis(module)


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"replicate expects nn.Module(s), got {type(m).__name__}")
        name = type(m).__name__
        if "replicate" in applied_apis(m):
            raise FullyShardUsageError(
                "Each distinct composable distributed API can only be applied to a module "
                f"once. replicate has already been applied to the following module:\n{m}\n"
                f"shardkit: apply replicate once per module ({name})"
            )
        if not is_composable_with_replicate(m):
            raise RuntimeError(
                "Cannot apply `replicate()` on a Module already managed by `fully_shard` "
                f"({name}); apply fully_shard or replicate to a module, not both"
            )
        if managed_by_torch_fsdp(m):
            raise ValueError(f"{name} is already managed by torch's FSDP; apply one FSDP only")
        # As torch: only a ModuleList or ModuleDict without a forward of its own is refused.
        if isinstance(m, nn.ModuleList | nn.ModuleDict) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"replicate does not support containers that do not implement forward: {m}\n"
                f"shardkit: {name} has no forward; apply replicate to the modules inside it"
            )


def _replicate_class(cls: type[nn.Module]) -> type[nn.Module]:
    if issubclass(cls, FSDPModule):
        return cls
    replicate_cls = _REPLICATE_CLASSES.get(cls)
    if replicate_cls is None:
        # TorchReplicateFacing makes it an instance of torch's ReplicateModule and FSDPModule
        # (libraries check those); after ours, so every method resolves to shardkit's.
        replicate_cls = type(
            f"Replicate{cls.__name__}", (ReplicateModule, TorchReplicateFacing, cls), {}
        )
        # Where the module's own class sits in the MRO (torch's attribute, read by its code).
        replicate_cls._orig_cls_mro_index = replicate_cls.__mro__.index(cls)  # type: ignore[attr-defined]
        _REPLICATE_CLASSES[cls] = replicate_cls
    return replicate_cls


_REPLICATE = ComposableApi("replicate", ReplicateModule, _replicate_class)

# As torch's ``replicate.state(module)`` (its composable-API decorator adds it): the view
# torch's pipelining reads. Set by name, as on fully_shard.
setattr(replicate, "state", _REPLICATE.state)  # noqa: B010
