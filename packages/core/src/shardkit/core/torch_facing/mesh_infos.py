"""torch's ``FSDPMeshInfo`` objects, built from a shardkit group's mesh for the torch-facing view.

Code written for torch's ``fully_shard`` reads a group's or a parameter's ``mesh_info``: the
shard group's size to scale a gradient norm it sums itself, ``isinstance(info, HSDPMeshInfo)``
to tell HSDP from FSDP, the shard process group for a collective of its own. It reads
``post_forward_mesh_info`` to learn whether a group reshards after forward (None: no;
``mesh_info`` itself: yes), and libraries set it to change that, as torch's
``set_reshard_after_forward`` does. The view answers with torch's own dataclasses (so
``isinstance`` against torch's classes holds), built once per group from the mesh and process
groups shardkit already holds: their construction looks groups up and creates none.

They describe the group; shardkit does not read them back, so writing a field of one changes
nothing (the view's ``post_forward_mesh_info`` setter is the one write that is served).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.fsdp._fully_shard import _fsdp_common as _torch_common

from shardkit.core.engine.mesh_info import MeshInfo

__all__ = ["as_torch_mesh_info", "is_torch_mesh_info"]


def as_torch_mesh_info(info: MeshInfo) -> Any:
    """The mesh-info object torch's ``fully_shard`` builds for ``info``'s mesh.

    ``FSDPMeshInfo``, ``HSDPMeshInfo``, or ``DDPMeshInfo`` (replicate only); with
    ``dp_mesh_dims``, its axis names and the whole mesh too (torch 2.12 on).
    """
    extra: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(_torch_common.DataParallelMeshInfo)}
    if info.spmd is not None and "dp_mesh_dims" in fields:  # torch 2.12 on
        from torch.distributed.fsdp import DataParallelMeshDims

        spmd = info.spmd
        dims = DataParallelMeshDims(shard=spmd.shard or None, replicate=spmd.replicate or None)
        extra = {"dp_mesh_dims": dims, "spmd_mesh": spmd.mesh}
    if not info.has_shard_axis:  # replicate only: the mesh is the replicate axis
        return _torch_common.DDPMeshInfo(info.mesh, replicate_mesh_dim=0, **extra)
    if info.replicate_group is not None:  # HSDP: (replicate, shard)
        hsdp = _torch_common.HSDPMeshInfo
        return hsdp(info.mesh, shard_mesh_dim=1, replicate_mesh_dim=0, **extra)
    return _torch_common.FSDPMeshInfo(info.mesh, shard_mesh_dim=0, **extra)


def is_torch_mesh_info(value: object) -> bool:
    """Whether ``value`` is one of torch's mesh-info objects."""
    return isinstance(value, _torch_common.DataParallelMeshInfo)
