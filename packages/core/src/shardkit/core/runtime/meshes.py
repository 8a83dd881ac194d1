"""The one module of the core that uses DeviceMesh's private API.

``fully_shard(..., dp_mesh_dims=...)`` takes the whole SPMD mesh and the names of its
data-parallel axes; several names become one axis (torch flattens them the same way), and
HSDP's replicate and shard axes become one 2-D mesh. torch 2.13 has no public API for either,
so both live here, where a torch upgrade that changes them breaks one file.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["concatenate", "flattened"]


def flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh of ``mesh``'s axes ``names`` (one axis: itself, no new process group).

    Several axes become one, named ``"_".join(names)`` as torch's ``fully_shard`` names it, so
    both build (and cache on the root mesh) the same flattened axis. Collective: every rank of
    ``mesh`` calls it, in the same order.
    """
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of ``meshes``, in order (slices of one root mesh).

    Raises:
        RuntimeError: the meshes overlap or come from different root meshes.
    """
    return DeviceMesh._concatenate(meshes)
