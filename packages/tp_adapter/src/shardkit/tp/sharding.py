"""FSDP over tensor-parallel parameters: the core's sharding extension for DTensor parameters.

After ``parallelize_module`` a parameter is a DTensor on the "tp" axis of a global mesh;
``fully_shard`` on the data-parallel axes of the same mesh then shards each TP rank's local
tensor across dp. The sharded parameter is one DTensor on the combined (dp..., tp) mesh; the
unsharded parameter, what forward sees, is the TP DTensor again, so TP's own collectives stay
DTensor's business and the engine's all-gather and reduce-scatter run over dp only.

When dp and TP shard the same tensor dim, TP shards first (each TP rank's rows are cut again
across dp), which DTensor spells ``_StridedShard(dim, split_factor=<TP shards of dim>)`` on the
dp axis; ``full_tensor()`` then puts every row back where it belongs, even for uneven sizes.
With ``fully_shard(..., dp_mesh_dims=...)`` the parameters are DTensors on the whole SPMD mesh
instead, which ``spmd_param_spec`` describes (see ``spmd_sharding.py``). See
[Note: tensor parallelism] in docs/notes/009-tensor-parallelism.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from shardkit.core.extensions import ParamShardingSpec, SpmdMeshAxes, make_dtensor
from shardkit.tp.spmd_sharding import settled_placements, spmd_param_spec
from shardkit.tp.torch_internals import concatenate_meshes, is_shard_on, strided_shard, waited

__all__ = ["TensorParallelSharding", "spmd_mesh"]


def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp axes..., tp axes...) mesh of a parameter sharded on both.

    Raises:
        ValueError: the meshes are not slices of one global mesh, they share an axis, or an
            axis has no name.
    """
    for role, mesh in (("data-parallel", dp_mesh), ("tensor-parallel", tp_mesh)):
        if mesh.mesh_dim_names is None:
            raise ValueError(
                f"the {role} mesh has no axis names: FSDP with tensor parallelism needs both "
                "meshes sliced by name from one global mesh, e.g. mesh = init_device_mesh("
                "'cpu', (2, 2), mesh_dim_names=('dp', 'tp')); fully_shard(..., mesh=mesh['dp'])"
            )
    shared = set(dp_mesh.mesh_dim_names or ()) & set(tp_mesh.mesh_dim_names or ())
    if shared:
        raise ValueError(
            f"the data-parallel mesh {dp_mesh.mesh_dim_names} overlaps the tensor-parallel "
            f"mesh {tp_mesh.mesh_dim_names} on axis {sorted(shared)}: pass fully_shard the "
            "data-parallel axes only, e.g. mesh['dp'] (or mesh['dp_replicate', 'dp_shard'])"
        )
    try:
        return concatenate_meshes([dp_mesh, tp_mesh])
    except RuntimeError as error:
        raise ValueError(
            f"the data-parallel mesh {dp_mesh.mesh_dim_names} and the tensor-parallel mesh "
            f"{tp_mesh.mesh_dim_names} are not slices of one global mesh ({error}); build one "
            "mesh with init_device_mesh and slice both from it"
        ) from None


def _split_factor(placements: tuple[Placement, ...], mesh: DeviceMesh, dim: int) -> int:
    """How many TP shards tensor dim ``dim`` is already cut into."""
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if is_shard_on(p, dim))


class TensorParallelSharding:
    """Shards DTensor parameters (tensor parallelism) across the data-parallel mesh.

    Installed with shardkit-tp, the core finds it by entry point; nothing to call.
    """

    def claims(self, param: nn.Parameter) -> bool:
        """Every DTensor parameter: one that ``parallelize_module`` distributed."""
        return isinstance(param, DTensor)

    def param_spec(
        self,
        param: nn.Parameter,
        *,
        shard_dim: int,
        dp_mesh: DeviceMesh,
        dp_placements: tuple[Placement, ...],
    ) -> ParamShardingSpec:
        """The TP-local tensor, sharded across dp; the sharded parameter on (dp..., tp...).

        Raises:
            ValueError: the meshes do not fit together, or the parameter is a partial sum.
        """
        assert isinstance(param, DTensor)
        tp_mesh = param.device_mesh
        tp_placements = tuple(param.placements)
        if any(p.is_partial() for p in tp_placements):
            raise ValueError(
                f"a parameter with placements {tp_placements} is a partial sum; tensor-parallel "
                "parameters must be Shard or Replicate on their mesh"
            )
        mesh = spmd_mesh(dp_mesh, tp_mesh)
        split = _split_factor(tp_placements, tp_mesh, shard_dim)
        dp_shard = strided_shard(shard_dim, split) if split > 1 else dp_placements[-1]
        return ParamShardingSpec(
            local=param.to_local().detach(),
            shard_dim=shard_dim,
            sharded_mesh=mesh,
            sharded_placements=(*dp_placements[:-1], dp_shard, *tp_placements),
            unsharded_mesh=tp_mesh,
            unsharded_placements=tp_placements,
            global_shape=param.shape,
            global_stride=tuple(param.stride()),
        )

    def spmd_param_spec(
        self, param: nn.Parameter, *, shard_dim: int, axes: SpmdMeshAxes
    ) -> ParamShardingSpec:
        """A DTensor on the whole SPMD mesh (``dp_mesh_dims``), sharded on its dp axes.

        Raises:
            ValueError: not ``Replicate()`` on a data-parallel axis, or a partial sum.
        """
        return spmd_param_spec(param, shard_dim, axes)

    def make_sharded(self, local_shard: torch.Tensor, spec: ParamShardingSpec) -> DTensor:
        """A DTensor on the SPMD mesh around the engine's shard (a view: no copy)."""
        return make_dtensor(
            local_shard,
            spec.sharded_mesh,
            spec.sharded_placements,
            spec.global_shape,
            spec.global_stride,
        )

    def make_unsharded(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The TP DTensor again, around the dp-gathered local tensor."""
        assert spec.unsharded_mesh is not None
        return make_dtensor(
            full_local,
            spec.unsharded_mesh,
            spec.unsharded_placements,
            spec.global_shape,
            spec.global_stride,
        )

    def chunk_full(self, full: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """This TP rank's part of a full tensor (no communication)."""
        assert spec.unsharded_mesh is not None
        with torch.no_grad():
            dtensor = distribute_tensor(
                full, spec.unsharded_mesh, spec.unsharded_placements, src_data_rank=None
            )
            return dtensor.to_local()

    def gather_full(self, full_local: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The full tensor from every TP rank's dp-gathered part (a collective over TP)."""
        with torch.no_grad():
            dtensor = self.make_unsharded(full_local, spec)
            assert isinstance(dtensor, DTensor)
            if all(isinstance(p, Replicate) for p in dtensor.placements):
                return full_local  # every TP rank holds all of it already
            return waited(dtensor.full_tensor())

    def grad_local(self, grad: torch.Tensor, spec: ParamShardingSpec) -> torch.Tensor:
        """The local gradient, once settled on the parameter's TP placements.

        A norm under SequenceParallel, for one, gets a Partial gradient (each TP rank saw
        part of the sequence): it is summed over TP here, before dp reduces it. On the whole
        SPMD mesh (``dp_mesh_dims``) the data-parallel axes are left as they are: the core's
        reduction sums a Partial there.
        """
        if not isinstance(grad, DTensor):
            return grad
        with torch.no_grad():
            target = settled_placements(tuple(grad.placements), spec)
            if tuple(grad.placements) != target:
                grad = grad.redistribute(placements=target)
            return waited(grad.to_local())
