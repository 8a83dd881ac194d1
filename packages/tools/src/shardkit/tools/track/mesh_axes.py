"""Which mesh axis a process group serves: data parallelism, tensor parallelism, ...

A DeviceMesh keeps one process group per axis and names its axes (``mesh_dim_names``), so a
collective's group says which axis it runs on, once the mesh is known. The meshes come from
two places, both public torch: the ones a caller names, and those of the DTensor parameters of
the modules that ran (after ``fully_shard`` a parameter lives on the data-parallel mesh, or on
the (dp, tp) mesh with tensor parallelism; after ``parallelize_module`` on the tp mesh).
Nothing else is asked of the engine, so this works for any program that uses DeviceMesh;
groups of no known mesh, and meshes without dim names, have no axis (None).

A parameter's mesh can be another object than the one its engine communicates on: DTensor's
in-place operators (the optimizer's) replace a parameter's spec with one from its sharding
cache, whose equal mesh may be an older object with older groups. shardkit's own groups are
therefore also read from the core's published layout view (``engine_meshes``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["axis_of_groups", "engine_meshes", "meshes_of"]


def meshes_of(modules: Iterable[nn.Module]) -> list[DeviceMesh]:
    """The meshes of the modules' DTensor parameters, each once, in the order found."""
    found: dict[int, DeviceMesh] = {}
    for module in modules:
        for param in module.parameters(recurse=False):
            if isinstance(param, DTensor):
                found.setdefault(id(param.device_mesh), param.device_mesh)
    return list(found.values())


def engine_meshes(modules: Iterable[nn.Module]) -> list[DeviceMesh]:
    """The data-parallel meshes that shardkit's engine shards these modules on, each once.

    Empty when shardkit-core is not installed or no module is sharded with it.
    """
    try:
        from shardkit.core import FSDPModule
        from shardkit.core.layout import layout_of
    except ImportError:  # shardkit-core is optional
        return []
    found: dict[int, DeviceMesh] = {}
    for module in modules:
        if isinstance(module, FSDPModule):
            for group in layout_of(module):
                found.setdefault(id(group.mesh), group.mesh)
    return list(found.values())


def axis_of_groups(meshes: Iterable[DeviceMesh]) -> dict[str, str]:
    """Process group name -> the dim name of the mesh axis it serves.

    A group that two meshes name differently keeps the first name (pass the meshes that
    should win first).
    A mesh whose process groups were destroyed (a report written at exit, after
    ``destroy_process_group``) names nothing: keep the axes found while it was alive.
    """
    axes: dict[str, str] = {}
    for mesh in meshes:
        names = mesh.mesh_dim_names
        if names is None:
            continue
        try:
            groups = mesh.get_all_groups()
        except RuntimeError:  # its groups are gone: torch cannot resolve their names
            continue
        for name, group in zip(names, groups, strict=True):
            axes.setdefault(group.group_name, name)
    return axes
