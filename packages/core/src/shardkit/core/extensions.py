"""The sharding extension point: parameters that are already DTensors on another mesh axis.

The core shards the tensor it is given along one dim of the data-parallel axis. Under tensor
parallelism that tensor is a TP rank's local part of a DTensor, and the sharded parameter must
be a DTensor on the combined (dp, tp) mesh; the unsharded parameter, the TP DTensor again. A
:class:`ShardingExtension` says how, per parameter; the core does the sharding itself.

Extensions are found through the packaging entry-point group ``shardkit.core.extensions``
(each entry names a zero-argument callable, a class for instance, that returns one), so an
installed ``shardkit-tp`` is used with no call from the user. :func:`register_extension`
adds one by hand. Plain tensors go to :class:`DataParallelSharding`, the core's own behaviour.

With ``fully_shard(..., dp_mesh_dims=...)`` every parameter is a DTensor on the whole SPMD mesh
already, replicated on the data-parallel axes; the extension that claims it must then also be
a :class:`SpmdShardingExtension`, which the core asks for the parameter's description given
the mesh's data-parallel axes (:class:`SpmdMeshAxes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from shardkit.core.runtime import dtensors

__all__ = [
    "ENTRY_POINT_GROUP",
    "DataParallelSharding",
    "ParamShardingSpec",
    "ShardingExtension",
    "SpmdMeshAxes",
    "SpmdShardingExtension",
    "extension_for",
    "make_dtensor",
    "register_extension",
    "registered_extensions",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "shardkit.core.extensions"


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamShardingSpec:
    """How one parameter is sharded, as an extension describes it to the core."""

    local: torch.Tensor
    """The tensor the data-parallel axis shards: the parameter itself, or under TP this
    rank's TP-local part of it. Once the engine has copied this rank's shard it keeps only a
    meta tensor of the same shape and dtype here, so the original's memory is freed."""
    shard_dim: int
    """The dim of ``local`` that the data-parallel axis shards (non-negative)."""
    sharded_mesh: DeviceMesh
    """The mesh of the sharded parameter (the dp mesh, or the whole SPMD mesh under TP)."""
    sharded_placements: tuple[Placement, ...]
    """Its placements on ``sharded_mesh``."""
    unsharded_mesh: DeviceMesh | None
    """The mesh of the unsharded parameter; None makes it a plain tensor (no TP)."""
    unsharded_placements: tuple[Placement, ...]
    """Its placements on ``unsharded_mesh`` (empty when that is None)."""
    global_shape: torch.Size
    """The parameter's full shape across every axis."""
    global_stride: tuple[int, ...]
    """The strides of the full parameter."""
    dp_axes: tuple[int, ...] = ()
    """Axes of ``unsharded_mesh`` that are data-parallel (``dp_mesh_dims``). The core's
    reduction sums gradients over them, so ``grad_local`` leaves a gradient's placements on
    these axes as they are: a ``Partial`` sum there is what the reduction adds up, and settling
    it first would be an all-reduce the reduction repeats."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpmdMeshAxes:
    """The whole SPMD mesh and its data-parallel axes, from ``fully_shard``'s ``dp_mesh_dims``."""

    mesh: DeviceMesh
    """The mesh passed to ``fully_shard``: every parameter is a DTensor on it."""
    shard: tuple[str, ...]
    """Its axes the parameters are sharded on (flattened into one when several; may be empty)."""
    replicate: tuple[str, ...]
    """Its axes the parameters are replicated across (likewise; may be empty)."""
    dp_mesh: DeviceMesh
    """The mesh the core gathers and reduces over, built from those axes: the shard axis, the
    replicate axis (replicate only), or (replicate, shard) for HSDP."""


@runtime_checkable
class ShardingExtension(Protocol):
    """Builds the sharded and unsharded forms of the parameters it claims."""

    def claims(self, param: nn.Parameter) -> bool:
        """Whether this extension handles ``param``."""

    def param_spec(
        self,
        param: nn.Parameter,
        *,
        shard_dim: int,
        dp_mesh: DeviceMesh,
        dp_placements: tuple[Placement, ...],
    ) -> ParamShardingSpec:
        """Describe ``param`` sharded on ``dp_mesh`` (``dp_placements``) along ``shard_dim``.

        Raises:
            ValueError: the parameter cannot be sharded on this mesh (name the reason).
        """

    def make_sharded(self, local_shard: torch.Tensor, spec: ParamShardingSpec) -> DTensor:
        """The sharded parameter's DTensor around ``local_shard`` (a view: no copy)."""

    def make_unsharded(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The unsharded parameter around ``full_local`` (``local`` gathered over dp)."""

    def chunk_full(self, full: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """From a full tensor of ``global_shape`` (a load), the part this rank's dp axis shards."""

    def gather_full(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """From ``local`` gathered over dp (a save), the full tensor of ``global_shape``."""

    def grad_local(self, grad: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The gradient of the unsharded parameter as a tensor shaped like ``local``.

        This is what the data-parallel reduction sums. Under TP the gradient is a DTensor
        whose placements may differ from the parameter's (a Partial sum after a
        sequence-parallel norm): the extension settles it on the unsharded placements first.
        """


@runtime_checkable
class SpmdShardingExtension(ShardingExtension, Protocol):
    """An extension that also takes parameters given on the whole SPMD mesh (``dp_mesh_dims``)."""

    def spmd_param_spec(
        self, param: nn.Parameter, *, shard_dim: int, axes: SpmdMeshAxes
    ) -> ParamShardingSpec:
        """Describe ``param``, a DTensor on ``axes.mesh``, sharded along ``shard_dim`` on dp.

        The spec's ``unsharded_mesh`` is ``axes.mesh`` and its ``dp_axes`` are the indices of
        the data-parallel axes there.

        Raises:
            ValueError: the parameter cannot be sharded so (not ``Replicate()`` on a
                data-parallel axis, say); the message says why.
        """


def make_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    global_shape: torch.Size,
    global_stride: tuple[int, ...] | None = None,
) -> DTensor:
    """A DTensor around ``local`` itself: no copy, no communication, no autograd edge.

    Extensions build the sharded parameter around a view of the engine's flat buffer, which
    the optimizer must write through; ``DTensor.from_local`` would add an autograd view.

    Args:
        local: this rank's part.
        mesh: the DTensor's mesh.
        placements: one per mesh axis.
        global_shape: the full shape.
        global_stride: the full tensor's strides (default: contiguous).
    """
    return dtensors.make_dtensor(local, mesh, placements, global_shape, global_stride)


class DataParallelSharding:
    """The core's own sharding: a plain tensor, sharded on the data-parallel mesh alone."""

    def claims(self, param: nn.Parameter) -> bool:
        """Every parameter that is not a DTensor already."""
        return not isinstance(param, DTensor)

    def param_spec(
        self,
        param: nn.Parameter,
        *,
        shard_dim: int,
        dp_mesh: DeviceMesh,
        dp_placements: tuple[Placement, ...],
    ) -> ParamShardingSpec:
        """The parameter as it is, sharded on the dp mesh."""
        return ParamShardingSpec(
            local=param,
            shard_dim=shard_dim,
            sharded_mesh=dp_mesh,
            sharded_placements=dp_placements,
            unsharded_mesh=None,
            unsharded_placements=(),
            global_shape=param.shape,
            global_stride=tuple(param.stride()),
        )

    def make_sharded(self, local_shard: torch.Tensor, spec: ParamShardingSpec) -> DTensor:
        """A DTensor on the dp mesh; its global stride is contiguous, as torch's is."""
        return make_dtensor(
            local_shard, spec.sharded_mesh, spec.sharded_placements, spec.global_shape
        )

    def make_unsharded(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The gathered tensor itself."""
        return full_local

    def chunk_full(self, full: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The full tensor itself: the dp axis shards all of it."""
        return full

    def gather_full(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The gathered tensor itself."""
        return full_local

    def grad_local(self, grad: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The gradient itself: the unsharded parameter is a plain tensor."""
        return grad


_DEFAULT = DataParallelSharding()
_registered: list[ShardingExtension] = []
_loaded_entry_points = False


def register_extension(extension: ShardingExtension) -> Callable[[], None]:
    """Use ``extension`` for the parameters it claims, before installed ones.

    Returns:
        A function that removes it again.

    Raises:
        TypeError: ``extension`` does not implement :class:`ShardingExtension`.
    """
    if not isinstance(extension, ShardingExtension):
        raise TypeError(
            f"{type(extension).__name__} does not implement shardkit.core.extensions."
            "ShardingExtension"
        )
    _registered.insert(0, extension)

    def unregister() -> None:
        if extension in _registered:
            _registered.remove(extension)

    return unregister


def _load_entry_points() -> None:
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        factory = entry.load()
        extension = factory()
        if not isinstance(extension, ShardingExtension):
            raise TypeError(
                f"entry point {entry.name} = {entry.value} in group {ENTRY_POINT_GROUP} "
                f"made a {type(extension).__name__}, which is not a ShardingExtension"
            )
        _registered.append(extension)
        logger.debug("sharding extension %s loaded from %s", entry.name, entry.value)


def registered_extensions() -> tuple[ShardingExtension, ...]:
    """The extensions in use besides the default: registered by hand, then installed."""
    _load_entry_points()
    return tuple(_registered)


def extension_for(param: nn.Parameter, fqn: str) -> ShardingExtension:
    """The extension that shards ``param`` (named ``fqn`` in messages).

    Raises:
        ValueError: ``param`` is a DTensor that no installed extension claims.
    """
    for extension in registered_extensions():
        if extension.claims(param):
            return extension
    if _DEFAULT.claims(param):
        return _DEFAULT
    mesh = getattr(param, "device_mesh", None)
    axes = getattr(mesh, "mesh_dim_names", None)
    raise ValueError(
        f"parameter {fqn} is already a DTensor (mesh axes {axes}, placements "
        f"{getattr(param, 'placements', None)}), as tensor parallelism makes it, and no "
        "installed sharding extension handles it: install shardkit-tp "
        "(pip install shardkit-tp) for FSDP with tensor parallelism"
    )
