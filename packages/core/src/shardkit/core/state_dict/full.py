"""Full state dicts, one parameter group at a time: the one generator every consumer shares.

:func:`iter_full_state_dict` yields ``(key, full tensor)`` pairs. For each group it gathers
the shards of its parameters (to the coordinator, or to every rank), rebuilds their full
tensors, yields them and lets them go before the next group, so no rank ever holds more than
one group beyond what the consumer keeps. The file writer is its first consumer; FSDP1's
FULL_STATE_DICT is the second.

The *coordinator* is the rank at the first coordinate of the parameters' mesh: the global
rank 0 for a mesh over the whole world, but under tensor parallelism the first rank of one
data-parallel group only, so nothing here asks for global rank 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.state_registry import is_managed, states_under
from shardkit.core.extensions import DataParallelSharding
from shardkit.core.runtime.buffers import copy_out_unsharded
from shardkit.core.runtime.collectives import ProcessGroupRuntime
from shardkit.core.runtime.groups import global_rank
from shardkit.core.runtime.p2p.agreement import Outcome, agreed
from shardkit.core.runtime.p2p.object_collectives import gather_to_first
from shardkit.core.runtime.protocol import rows_of
from shardkit.core.state_dict.validation import model_mesh, param_keys

__all__ = [
    "FullStateDictPlan",
    "coordinator_rank",
    "dp_pieces",
    "gather_rows",
    "group_pieces",
    "iter_full_state_dict",
    "iter_pieces",
    "iter_planned",
    "param_pieces",
    "plain_pieces",
    "plan_full_state_dict",
    "sharded_groups",
]


def coordinator_rank(mesh: DeviceMesh) -> int:
    """The global rank at the first coordinate of ``mesh``: the one that writes and reads."""
    return int(mesh.mesh.flatten()[0])


@dataclass(frozen=True, slots=True)
class FullStateDictPlan:
    """A model's state dict as groups of sharded parameters plus plain tensors, in order."""

    keys: list[str]
    """Every key, in the order the generator yields them: group by group, then the plain
    tensors (buffers, ignored parameters), each in the model's state-dict order."""
    sharded: dict[str, tuple[FSDPParamGroup, int]]
    """A sharded parameter's key -> (its group, its index there)."""
    plain: dict[str, torch.Tensor]
    """Buffers and parameters that no group shards."""
    groups: list[FSDPParamGroup]
    """The groups, in the order they are gathered."""
    expected: dict[str, torch.Tensor]
    """The model's own state dict (sharded parameters as DTensors), for validation."""
    coordinator: int
    """The global rank that writes and reads files for this model."""

    def keys_of(self, group: FSDPParamGroup) -> list[str]:
        """The keys of ``group``'s parameters, in yield order."""
        return [k for k in self.keys if k in self.sharded and self.sharded[k][0] is group]


def sharded_groups(model: nn.Module) -> list[FSDPParamGroup]:
    """The parameter groups in ``model``'s tree, resharded (the shards are the truth).

    Raises:
        TypeError: ``model`` is not sharded with shardkit's ``fully_shard``.
        RuntimeError: a group's parameters are still on the meta device.
    """
    if not is_managed(model):
        raise TypeError(f"{type(model).__name__} is not sharded with shardkit's fully_shard")
    groups = [g for s in states_under(model) for g in s.groups]
    for group in groups:
        group.reshard()
        group.check_materialized()
    return groups


def plan_full_state_dict(model: nn.Module, groups: list[FSDPParamGroup]) -> FullStateDictPlan:
    """Which key comes from where, and in which order the generator yields it.

    Raises:
        NotImplementedError: a parameter is gathered through all-gather hooks.
    """
    expected = model.state_dict(keep_vars=True)
    owner = param_keys(model, groups, expected)
    hooked = [k for k, (g, i) in owner.items() if g.params[i].hooks is not None]
    if hooked:
        # Their shards are tensor subclasses, not bytes of the group's buffer; only the
        # subclass knows its values. DTensor's full_tensor() asks it, as torch's DSD does.
        raise NotImplementedError(
            f"full state dicts of {type(model).__name__} through shardkit (iter_full_state_dict, "
            "save_full_state_dict, load_full_state_dict) do not support parameters with "
            f"all-gather hooks (fsdp_pre_all_gather / fsdp_post_all_gather): {hooked}. Use "
            "torch.distributed.checkpoint (dcp.save / dcp.load, or get_model_state_dict("
            "full_state_dict=True)), which handles them as with torch's fully_shard"
        )
    sharded = {k: owner[k] for k in expected if k in owner}
    plain = {k: v for k, v in expected.items() if k not in owner and isinstance(v, torch.Tensor)}
    keys = [k for g in groups for k in sharded if sharded[k][0] is g] + list(plain)
    if groups:
        first = groups[0].params[0].sharding_spec.sharded_mesh
        coordinator = coordinator_rank(first)
    else:
        coordinator = 0
    return FullStateDictPlan(keys, sharded, plain, groups, dict(expected), coordinator)


def iter_full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, full tensor)`` for every entry of ``model``'s state dict.

    Every rank must run the generator to its end: it gathers shards with collectives.

    Args:
        model: a model sharded with shardkit's ``fully_shard`` (the root).
        rank0_only: True yields only on the coordinator (the others get nothing); False
            yields on every rank.
        cpu_offload: True yields CPU tensors; False leaves them on the parameters' device.

    Raises:
        TypeError: ``model`` is not sharded with shardkit's ``fully_shard``.
    """
    plan = plan_full_state_dict(model, sharded_groups(model))
    yield from iter_planned(plan, rank0_only=rank0_only, cpu_offload=cpu_offload)


def iter_planned(
    plan: FullStateDictPlan, *, rank0_only: bool, cpu_offload: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_full_state_dict` for a plan already made (the file writer needs it first)."""
    for key, pieces in iter_pieces(plan, rank0_only=rank0_only, cpu_offload=cpu_offload):
        shape = plan.expected[key].shape
        yield key, pieces[0].view(shape) if len(pieces) == 1 else torch.cat(pieces).view(shape)


def iter_pieces(
    plan: FullStateDictPlan, *, rank0_only: bool, cpu_offload: bool
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """The generator under :func:`iter_full_state_dict`: each full tensor as flat pieces.

    The pieces, joined in order, are the tensor's data. A parameter sharded on dim 0 comes as
    each rank's unpadded shard, straight from the gathered rows: a consumer that streams them
    (the file writer) never copies the tensor whole.
    """
    if rank0_only:
        yield from _coordinator_pieces(plan, cpu_offload=cpu_offload)
        return
    for group in plan.groups:
        yield from group_pieces(plan, group, rank0_only=rank0_only, cpu_offload=cpu_offload)
    yield from plain_pieces(plan, rank0_only=rank0_only, cpu_offload=cpu_offload)


def _coordinator_pieces(
    plan: FullStateDictPlan, *, cpu_offload: bool
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """:func:`iter_pieces` with ``rank0_only``: the coordinator's failure raised on every rank.

    Only the coordinator rebuilds and copies full tensors (to the CPU: where a rank that
    holds the whole model runs out of memory). If that fails, it yields nothing more but
    keeps taking part in the remaining groups' gathers, and at the end every rank raises its
    error instead of waiting in a gather the coordinator never joins.
    """
    failures: list[Exception] = []
    for group in plan.groups:
        pieces = group_pieces(plan, group, rank0_only=True, cpu_offload=cpu_offload)
        if failures:
            # Gathered and dropped, so that this rank stays in step with the others; a
            # failure again (the same shortage) adds nothing to the first.
            with contextlib.suppress(Exception):
                for _ in pieces:
                    pass
            continue
        try:
            yield from pieces
        except Exception as error:
            failures.append(error)
    if not failures:
        try:
            yield from plain_pieces(plan, rank0_only=True, cpu_offload=cpu_offload)
        except Exception as error:
            failures.append(error)

    def outcome() -> None:
        if failures:
            error = failures[0]
            message = f"the full state dict could not be gathered here: {error}"
            raise Outcome(None, type(error).__name__, message).exception() from error

    agreed(outcome, model_mesh(plan.groups))  # the model's ranks only, as the gathers


def group_pieces(
    plan: FullStateDictPlan, group: FSDPParamGroup, *, rank0_only: bool, cpu_offload: bool
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """:func:`iter_pieces` for one group: every rank runs it to its end (it gathers)."""
    receives = not rank0_only or global_rank() == plan.coordinator
    # An extension's gather (across TP) runs on the mesh's device: offload after it.
    plain = all(isinstance(p.extension, DataParallelSharding) for p in group.params)
    rows = gather_rows(group, to_all=not rank0_only, cpu=cpu_offload and plain)
    if rows is None:
        return  # this rank only sent
    for key in plan.keys_of(group):
        # Under TP every data-parallel group has a first rank holding rows, and they all
        # take part in the extension's gather across TP; only the coordinator keeps it.
        pieces = param_pieces(group, plan.sharded[key][1], rows)
        if receives:
            yield key, [piece.cpu() for piece in pieces] if cpu_offload else pieces


def plain_pieces(
    plan: FullStateDictPlan, *, rank0_only: bool, cpu_offload: bool
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """:func:`iter_pieces` for the tensors that no group shards (no collective)."""
    if rank0_only and global_rank() != plan.coordinator:
        return
    for key, tensor in plan.plain.items():
        value = tensor.detach()
        yield key, [value.cpu() if cpu_offload else value]


def gather_rows(group: FSDPParamGroup, *, to_all: bool, cpu: bool) -> list[torch.Tensor] | None:
    """Every shard rank's sharded buffer (bytes), in rank order; None where not wanted."""
    mesh_info = group.mesh_info
    if to_all:
        handle = ProcessGroupRuntime().all_gather(
            group.sharded_buffer, mesh_info.shard_group, label=group.fqn
        )
        rows = rows_of(handle.wait())
    else:
        replicate = mesh_info.replicate_group
        if replicate is not None and replicate.rank() != 0:
            return None  # one replica is enough
        gathered = gather_to_first(group.sharded_buffer, mesh_info.shard_group)
        if gathered is None:
            return None
        rows = gathered
    return [row.cpu() for row in rows] if cpu else rows


def dp_pieces(group: FSDPParamGroup, index: int, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Parameter ``index`` of ``group`` gathered over dp, as pieces of its flat data.

    That is the full tensor, except under tensor parallelism: there, this rank's TP part.
    """
    p = group.params[index]
    geo = p.geometry
    shards = [group.layout.storage.view(row, index) for row in rows]
    if geo.dim == 0:
        # A dim-0 shard is a run of whole rows of the full tensor: the unpadded ones, in order.
        return [s[: geo.local_length(r) * geo.row_numel] for r, s in enumerate(shards)]
    padded = torch.empty(geo.world * geo.shard_numel, dtype=p.orig_dtype, device=rows[0].device)
    copy_out_unsharded(shards, geo, padded)
    return [padded[: geo.shape.numel()]]


def param_pieces(group: FSDPParamGroup, index: int, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Parameter ``index`` of ``group`` as pieces of its flat data, from the gathered rows."""
    p = group.params[index]
    geo = p.geometry
    pieces = dp_pieces(group, index, rows)
    if isinstance(p.extension, DataParallelSharding):
        return pieces  # the dp-gathered tensor is the full tensor
    dp_full = pieces[0].view(geo.shape) if len(pieces) == 1 else torch.cat(pieces).view(geo.shape)
    return [p.extension.gather_full(dp_full, p.sharding_spec).reshape(-1)]
