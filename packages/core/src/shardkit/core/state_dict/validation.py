"""All-or-nothing ``load_state_dict`` for FSDP modules.

``nn.Module.load_state_dict`` writes parameter by parameter and reports shape mismatches
only at the end, so a bad checkpoint leaves a model half-loaded (torch's own fully_shard too).
Here every key is checked first, and one error lists every problem before anything is written.
Plain full tensors are accepted for sharded parameters: each rank takes its own shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.dtensors import as_dtensor, make_dtensor

__all__ = [
    "LoadProblem",
    "check_state_dict",
    "format_problems",
    "model_mesh",
    "param_keys",
    "shard_full_tensors",
]


@dataclass(frozen=True, slots=True)
class LoadProblem:
    """One offending key of a state dict."""

    key: str
    problem: str  # "missing", "unexpected", "type", "shape", "data", "mesh", "shard", "device"
    expected: str
    found: str

    def __str__(self) -> str:
        if self.problem in ("missing", "unexpected"):
            return f"  {self.key}: {self.problem} key ({self.expected or self.found})"
        return (
            f"  {self.key}: {self.problem} mismatch, expected {self.expected}, found {self.found}"
        )


def param_keys(
    root: nn.Module, groups: list[FSDPParamGroup], expected: Mapping[str, Any]
) -> dict[str, tuple[FSDPParamGroup, int]]:
    """State-dict key (relative to ``root``) of every slot of every sharded parameter.

    A tied parameter has one key per slot; each maps to (its group, its index there). Keys
    are those of ``expected``, ``root.state_dict(keep_vars=True)``, found by the parameter
    objects it holds: state-dict hooks may rename keys (torch's activation-checkpoint wrapper
    drops its ``_checkpoint_wrapped_module.``), so the module path is not always the key. A
    parameter the state dict does not hold as its sharded object (registered unsharded just
    now) gets the key of its module path.
    """
    owners = {id(p.sharded_param): (g, i) for g in groups for i, p in enumerate(g.params)}
    keys = {k: owners[id(v)] for k, v in expected.items() if id(v) in owners}
    found = {id(owner[0].params[owner[1]]) for owner in keys.values()}
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    for group in groups:
        for index, p in enumerate(group.params):
            if id(p) in found:
                continue
            for slot in p.slots:
                if id(slot.module) in names:
                    keys[f"{names[id(slot.module)]}.{slot.name}".lstrip(".")] = (group, index)
    return keys


def _describe(value: torch.Tensor) -> str:
    return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"


def check_state_dict(
    expected: Mapping[str, Any],
    given: Mapping[str, Any],
    *,
    strict: bool,
    cpu_only: bool,
    placeholders: bool = False,
) -> list[LoadProblem]:
    """Every problem of loading ``given`` into a module whose state dict is ``expected``.

    Everything that would make the load fail part-way is a problem here, so that nothing is
    written when the load cannot finish. Another dtype is not: the copy converts it, as
    ``nn.Module.load_state_dict`` does (bf16 weights into an fp32 model).

    Args:
        expected: the module's own state dict (``keep_vars=True``).
        given: the state dict to load.
        strict: missing and unexpected keys are problems.
        cpu_only: tensors off the CPU are problems (``CPUOffloadPolicy``).
        placeholders: ``given`` holds meta tensors standing for a file's entries: only keys
            and shapes are checked.
    """
    problems: list[LoadProblem] = []
    for key, want in expected.items():
        if not isinstance(want, torch.Tensor):
            continue
        if key not in given:
            if strict:
                problems.append(LoadProblem(key, "missing", _describe(want), ""))
            continue
        problem = _value_problem(key, want, given[key], cpu_only, placeholders)
        if problem is not None:
            problems.append(problem)
    if strict:
        for key, value in given.items():
            if key not in expected and isinstance(value, torch.Tensor):
                problems.append(LoadProblem(key, "unexpected", "", _describe(value)))
    return problems


def _value_problem(
    key: str, want: torch.Tensor, value: Any, cpu_only: bool, placeholders: bool
) -> LoadProblem | None:
    """What would make copying (or assigning) ``value`` into ``want`` fail, if anything."""
    if not isinstance(value, torch.Tensor):
        return LoadProblem(key, "type", "a tensor", type(value).__name__)
    if value.shape != want.shape:
        return LoadProblem(key, "shape", _describe(want), _describe(value))
    if placeholders:
        return None
    if cpu_only and value.device.type != "cpu":
        return LoadProblem(key, "device", "cpu (CPUOffloadPolicy)", str(value.device))
    if value.is_meta and not want.is_meta:
        return LoadProblem(key, "data", "a tensor with values", "a meta tensor (no data)")
    if isinstance(value, DTensor):
        if not isinstance(want, DTensor):
            return LoadProblem(key, "type", "a plain tensor (not sharded)", "a DTensor")
        if value.device_mesh != want.device_mesh:
            return LoadProblem(
                key, "mesh", str(want.device_mesh), f"{value.device_mesh} (load it through DCP)"
            )
        mine, theirs = want.to_local().shape, value.to_local().shape
        if value.placements == want.placements and mine != theirs:
            # Built with from_local(run_check=False) from a short or foreign shard: the copy
            # would fail on this rank alone, part-way.
            return LoadProblem(key, "shard", f"this rank's shard {tuple(mine)}", str(tuple(theirs)))
    return None


def model_mesh(groups: list[FSDPParamGroup]) -> DeviceMesh | None:
    """The mesh that holds every rank of the meshes ``groups``' parameters live on.

    Those ranks hold the parts of one model, so they load it together
    (``FSDPModule.load_state_dict`` agrees among them, on this mesh's own groups). A model's
    meshes are one mesh or slices of one (the data-parallel axes of an SPMD mesh, TP axes
    included): the largest holds the others. Among meshes of the same ranks, every rank takes
    the same one (by its groups' names), so that they agree on the same groups. None: no
    parameter, nobody to agree with.

    Raises:
        ValueError: no one of the meshes holds every rank of the others.
    """
    meshes = {id(m): m for g in groups for m in (p.sharding_spec.sharded_mesh for p in g.params)}
    if not meshes:
        return None
    ranks_of = {key: set(mesh.mesh.flatten().tolist()) for key, mesh in meshes.items()}
    every = set().union(*ranks_of.values())
    holding = [meshes[key] for key, ranks in ranks_of.items() if ranks == every]
    if not holding:
        shown = ", ".join(str(mesh.mesh.tolist()) for mesh in meshes.values())
        raise ValueError(
            f"the model's parameters live on meshes of which none holds every rank of the "
            f"others ({shown}): its ranks cannot agree on a load. Take every mesh from one "
            "mesh (init_device_mesh, then slice it)"
        )

    def order(mesh: DeviceMesh) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
        names = tuple(mesh.get_group(axis).group_name for axis in range(mesh.ndim))
        return tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), names

    return min(holding, key=order)


def format_problems(module: nn.Module, problems: list[LoadProblem], source: str = "") -> str:
    """One message listing every problem, for the error raised before anything is written.

    ``source`` names the file the state dict comes from, if any.
    """
    lines = "\n".join(str(p) for p in problems)
    origin = f" from {source}" if source else ""
    return (
        f"load_state_dict{origin} into {type(module).__name__} found {len(problems)} "
        f"problem(s); nothing was loaded, every parameter is as it was:\n{lines}"
    )


def shard_full_tensors(
    given: Mapping[str, Any], params_by_key: Mapping[str, FSDPParam]
) -> dict[str, Any]:
    """Replace plain full tensors of sharded parameters by this rank's shard, as DTensors."""
    out = dict(given)
    for key, fsdp_param in params_by_key.items():
        value = given.get(key)
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        dp_full = fsdp_param.extension.chunk_full(value, fsdp_param.sharding_spec)
        rank = fsdp_param.mesh_info.shard_rank
        local = fsdp_param.geometry.local_shard(dp_full, rank).contiguous()
        like = as_dtensor(fsdp_param.sharded_param)
        # In the given dtype: a copy converts it, an assign keeps it (as nn.Module's load).
        out[key] = make_dtensor(local, like.device_mesh, like.placements, like.shape, like.stride())
    return out
