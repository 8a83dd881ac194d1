"""Sharding extensions used by the extension-point tests (imported by name in the workers)."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from shardkit.core.extensions import DataParallelSharding, ParamShardingSpec, SpmdMeshAxes


class RecordingSharding(DataParallelSharding):
    """The core's own sharding, counting each hook the engine calls."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def param_spec(
        self,
        param: nn.Parameter,
        *,
        shard_dim: int,
        dp_mesh: DeviceMesh,
        dp_placements: tuple[Placement, ...],
    ) -> ParamShardingSpec:
        self.calls["param_spec"] += 1
        return super().param_spec(
            param, shard_dim=shard_dim, dp_mesh=dp_mesh, dp_placements=dp_placements
        )

    def make_sharded(self, local_shard: torch.Tensor, spec: ParamShardingSpec) -> DTensor:
        self.calls["make_sharded"] += 1
        return super().make_sharded(local_shard, spec)

    def make_unsharded(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        self.calls["make_unsharded"] += 1
        return super().make_unsharded(full_local, spec)

    def chunk_full(self, full: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        self.calls["chunk_full"] += 1
        return super().chunk_full(full, spec)

    def grad_local(self, grad: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        self.calls["grad_local"] += 1
        return super().grad_local(grad, spec)


class ReplicatedDTensorSharding:
    """Parameters that are DTensors replicated on the data-parallel mesh itself.

    A small real extension written against the public protocol only: the tensor the dp axis
    shards is the replica, and the sharded parameter is built with ``DTensor.from_local``.
    """

    def claims(self, param: nn.Parameter) -> bool:
        return isinstance(param, DTensor) and all(p.is_replicate() for p in param.placements)

    def param_spec(
        self,
        param: nn.Parameter,
        *,
        shard_dim: int,
        dp_mesh: DeviceMesh,
        dp_placements: tuple[Placement, ...],
    ) -> ParamShardingSpec:
        assert isinstance(param, DTensor)
        if param.device_mesh != dp_mesh:
            raise ValueError("ReplicatedDTensorSharding: the parameter is on another mesh")
        return ParamShardingSpec(
            local=param.to_local(),
            shard_dim=shard_dim,
            sharded_mesh=dp_mesh,
            sharded_placements=dp_placements,
            unsharded_mesh=None,
            unsharded_placements=(),
            global_shape=param.shape,
            global_stride=tuple(param.stride()),
        )

    def make_sharded(self, local_shard: torch.Tensor, spec: ParamShardingSpec) -> DTensor:
        return DTensor.from_local(
            local_shard,
            spec.sharded_mesh,
            spec.sharded_placements,
            run_check=False,
            shape=spec.global_shape,
            stride=spec.global_stride,
        )

    def make_unsharded(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        return full_local

    def chunk_full(self, full: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        return full

    def gather_full(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        return full_local

    def grad_local(self, grad: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        return grad


class SpmdReplicatedSharding(ReplicatedDTensorSharding):
    """DTensors replicated on a 1-D mesh given whole to ``fully_shard(..., dp_mesh_dims=)``.

    Implements the SPMD seam only as far as a 1-D mesh needs: the sharded parameter is on
    the whole mesh, Shard(dim) when the axis is sharded and Replicate() when it is only
    replicated; the unsharded parameter is a plain tensor. It records the axes it was given.
    """

    def __init__(self) -> None:
        self.axes: list[SpmdMeshAxes] = []

    def spmd_param_spec(
        self, param: nn.Parameter, *, shard_dim: int, axes: SpmdMeshAxes
    ) -> ParamShardingSpec:
        assert isinstance(param, DTensor)
        self.axes.append(axes)
        placement: Placement = Shard(shard_dim) if axes.shard else Replicate()
        return ParamShardingSpec(
            local=param.to_local(),
            shard_dim=shard_dim,
            sharded_mesh=axes.mesh,
            sharded_placements=(placement,),
            unsharded_mesh=None,
            unsharded_placements=(),
            global_shape=param.shape,
            global_stride=tuple(param.stride()),
            dp_axes=(0,),
        )
