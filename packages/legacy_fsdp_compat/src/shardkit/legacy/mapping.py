"""The one mapping table: FSDP1's constructor arguments as ``fully_shard``'s.

Every wrapper (the root and each auto-wrapped unit) becomes one ``fully_shard`` group on its
module. What FSDP1 expresses with a sharding strategy and process groups, the core expresses
with ``reshard_after_forward`` and the shape of the data-parallel mesh:

==================== ========================= =====================================
FSDP1 strategy        ``reshard_after_forward``  mesh
==================== ========================= =====================================
FULL_SHARD            None (all but the root)    1-D over the process group
SHARD_GRAD_OP         False                      1-D over the process group
NO_SHARD              False                      (W, 1): replicated, nothing sharded
HYBRID_SHARD          None                       (replicate, shard)
_HYBRID_SHARD_ZERO2   False                      (replicate, shard)
==================== ========================= =====================================

The package README has the whole table, every argument included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardkit.core import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shardkit.legacy.configs import CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["STRATEGIES", "CoreArgs", "StrategyMapping", "core_args", "resolve_mesh"]


@dataclass(frozen=True, slots=True)
class StrategyMapping:
    """What one FSDP1 sharding strategy is in the core's terms."""

    reshard_after_forward: bool | None
    """``fully_shard``'s argument (None: free after forward, except the root)."""
    mesh: str
    """"shard" (1-D), "replicate" ((W, 1)) or "hybrid" ((replicate, shard))."""


STRATEGIES: dict[ShardingStrategy, StrategyMapping] = {
    ShardingStrategy.FULL_SHARD: StrategyMapping(None, "shard"),
    ShardingStrategy.SHARD_GRAD_OP: StrategyMapping(False, "shard"),
    ShardingStrategy.NO_SHARD: StrategyMapping(False, "replicate"),
    ShardingStrategy.HYBRID_SHARD: StrategyMapping(None, "hybrid"),
    ShardingStrategy["_HYBRID_SHARD_ZERO2"]: StrategyMapping(False, "hybrid"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class CoreArgs:
    """``fully_shard``'s keyword arguments for one wrapper."""

    mesh: DeviceMesh
    reshard_after_forward: bool | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy


def core_args(
    strategy: ShardingStrategy,
    mesh: DeviceMesh,
    mixed_precision: MixedPrecision | None,
    cpu_offload: CPUOffload | None,
) -> CoreArgs:
    """``fully_shard``'s arguments for a wrapper with these FSDP1 settings.

    Input casting is the wrapper's business (FSDP1 casts the root's inputs and, optionally,
    every unit's), so the core casts none; buffers and low-precision gradients too.
    """
    mp = mixed_precision
    # FSDP1 reduces in param_dtype when reduce_dtype is None, on every torch release; FSDP2's
    # None means the parameters' own dtype from torch 2.15 on, so it is never passed on.
    policy = MixedPrecisionPolicy(
        param_dtype=mp.param_dtype if mp is not None else None,
        reduce_dtype=(mp.reduce_dtype or mp.param_dtype) if mp is not None else None,
        cast_forward_inputs=False,
    )
    offload = cpu_offload is not None and cpu_offload.offload_params
    return CoreArgs(
        mesh=mesh,
        reshard_after_forward=STRATEGIES[strategy].reshard_after_forward,
        mp_policy=policy,
        offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
    )


# Meshes built from process groups, by (kind, groups): every unit of a model shares one, and
# the groups are held so that their ids are not reused while the mesh lives.
_MESHES: dict[tuple[str, int, int], tuple[DeviceMesh, tuple[object, ...]]] = {}

_NAMES = ("replicate", "shard")


def resolve_mesh(
    strategy: ShardingStrategy,
    process_group: object,
    device_mesh: DeviceMesh | None,
    device_type: str,
) -> DeviceMesh:
    """The data-parallel mesh of a wrapper, from FSDP1's ``process_group`` / ``device_mesh``.

    Raises:
        ValueError: both were given, a hybrid strategy got one process group, or a mesh of
            the wrong number of axes for the strategy.
    """
    kind = STRATEGIES[strategy].mesh
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("Cannot pass both process_group and device_mesh at the same time")
        return _from_device_mesh(device_mesh, kind)
    if kind == "hybrid":
        return _hybrid_mesh(process_group, device_type)
    group = process_group if process_group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"process_group must be a ProcessGroup for {strategy.name}, got "
            f"{type(process_group).__name__}"
        )
    key = (kind, id(group), 0)
    if key not in _MESHES:
        flat = DeviceMesh.from_group(group, device_type)
        mesh = _replicated(flat) if kind == "replicate" else flat
        _MESHES[key] = (mesh, (group,))
    return _MESHES[key][0]


def _from_device_mesh(mesh: DeviceMesh, kind: str) -> DeviceMesh:
    if kind == "hybrid":
        if mesh.ndim != 2:
            raise ValueError(
                f"a hybrid sharding strategy needs a 2-D device_mesh (replicate, shard), got "
                f"a {mesh.ndim}-D one"
            )
        if mesh.mesh_dim_names is None:
            groups = [mesh.get_group(0), mesh.get_group(1)]
            return DeviceMesh.from_group(
                groups, mesh.device_type, mesh=mesh.mesh, mesh_dim_names=_NAMES
            )
        return mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"FULL_SHARD, SHARD_GRAD_OP and NO_SHARD need a 1-D device_mesh, got a {mesh.ndim}-D "
            "one; use HYBRID_SHARD for (replicate, shard)"
        )
    return _replicated(mesh) if kind == "replicate" else mesh


def _replicated(mesh: DeviceMesh) -> DeviceMesh:
    """NO_SHARD: every rank of ``mesh`` a replica, each a shard group of one."""
    group = mesh.get_group(0)
    if mesh.size() == 1:
        # One rank (FSDP1 makes such a unit NO_SHARD): its own group serves both axes.
        return DeviceMesh.from_group(
            [group, group], mesh.device_type, mesh=mesh.mesh.view(1, 1), mesh_dim_names=_NAMES
        )
    if mesh.size() == dist.get_world_size():
        return DeviceMesh(mesh.device_type, mesh.mesh.view(-1, 1), mesh_dim_names=_NAMES)
    # Some ranks of the world: a new mesh would make its groups with every rank of the world
    # (ranks elsewhere building other units would pair with these and hang), so the replicas
    # are the group given and each shard axis a group of this rank, made by it alone.
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return DeviceMesh.from_group(
        [group, alone], mesh.device_type, mesh=mesh.mesh.view(-1, 1), mesh_dim_names=_NAMES
    )


def _hybrid_mesh(process_group: object, device_type: str) -> DeviceMesh:
    if process_group is None:
        # FSDP1 shards within a node (its devices) and replicates across nodes.
        per_node = _devices_per_node(device_type)
        world = dist.get_world_size()
        key = ("hybrid-default", per_node, world)
        if key not in _MESHES:
            layout = torch.arange(world).view(world // per_node, per_node)
            _MESHES[key] = (DeviceMesh(device_type, layout, mesh_dim_names=_NAMES), ())
        return _MESHES[key][0]
    if not (
        isinstance(process_group, tuple)
        and len(process_group) == 2
        and all(isinstance(g, dist.ProcessGroup) for g in process_group)
    ):
        raise ValueError(
            "Expected process_group to be passed in as either None or "
            f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)} "
            "(hybrid strategies take (intra-node shard group, inter-node replicate group))"
        )
    intra, inter = process_group
    key = ("hybrid", id(intra), id(inter))
    if key not in _MESHES:
        shards, replicas = intra.size(), inter.size()
        layout = torch.arange(shards * replicas).view(replicas, shards)
        mine = layout[inter.rank(), intra.rank()].item()
        if mine != dist.get_rank() or dist.get_process_group_ranks(intra) != list(
            layout[inter.rank()].tolist()
        ):
            raise ValueError(
                "process_group=(intra, inter) must lay the ranks out as FSDP1's default does "
                "(shard groups of consecutive ranks); pass device_mesh for other layouts"
            )
        mesh = DeviceMesh.from_group(
            [inter, intra], device_type, mesh=layout, mesh_dim_names=_NAMES
        )
        _MESHES[key] = (mesh, process_group)
    return _MESHES[key][0]


def _devices_per_node(device_type: str) -> int:
    if device_type == "cpu":
        return 1  # FSDP1 counts one CPU "device" per node
    return max(1, torch.accelerator.device_count())
