"""Full parameters on a sharded model for a while, then back to shards (with or without edits).

``full_params(model)`` gathers every group's shards in the parameters' own dtype (mixed
precision plays no part), registers the full tensors as the modules' parameters, and on
exit writes each rank's shard of them back into the sharded parameters (``writeback``) and
registers those again. Weight surgery, generation with full weights (RL) and FSDP1's
``summon_full_params`` use it; nothing of forward or backward changes.

The sharded parameter objects stay the same throughout, so optimizers and their state keep
their references; the full parameters are new objects, alive only inside the context.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.param_listing import read_slot, write_slot
from shardkit.core.engine.state_registry import is_managed, state_of, states_under
from shardkit.core.extensions import DataParallelSharding
from shardkit.core.runtime.dtensors import local_of
from shardkit.core.runtime.groups import global_rank
from shardkit.core.state_dict.full import coordinator_rank, dp_pieces, gather_rows
from shardkit.core.state_machines import TrainingState

__all__ = ["full_params"]

# Groups whose full parameters are registered right now: gathering them again inside would
# overwrite the first context's parameters, so it is refused.
_ACTIVE: weakref.WeakSet[FSDPParamGroup] = weakref.WeakSet()


@contextmanager
def full_params(
    module: nn.Module,
    *,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Register full parameters on ``module``'s tree inside the context.

    Every rank must enter it (it gathers with collectives).

    Args:
        module: a module sharded with shardkit's ``fully_shard``.
        recurse: every group in ``module``'s tree; False: ``module``'s own group only.
        writeback: on a normal exit, each rank keeps its shard of the full parameters as
            they are then (changes made inside are kept); False discards them.
        rank0_only: only the coordinator (the mesh's first rank) gets full parameters; the
            others keep their shards registered. Cannot be combined with ``writeback``.
        offload_to_cpu: the full parameters live on the CPU.
        with_grads: the full parameters get the full (reduced) gradients of the shards.

    Raises:
        TypeError: ``module`` is not sharded with shardkit's ``fully_shard``.
        ValueError: ``writeback`` and ``rank0_only`` together.
        RuntimeError: a group is in forward or backward, or already inside ``full_params``.
        NotImplementedError: a parameter is gathered through all-gather hooks, or
            ``with_grads`` on a tensor-parallel parameter.
    """
    if writeback and rank0_only:
        raise ValueError(
            "full_params: writeback=True and rank0_only=True cannot be combined (the other "
            "ranks would write back nothing)"
        )
    groups = _groups(module, recurse)
    for group in groups:
        _check_usable(group, with_grads)
    gathered: list[_Gathered] = []
    _ACTIVE.update(groups)
    try:
        for group in groups:
            group.reshard()
            group.check_materialized()
            gathered.append(_gather(group, rank0_only, offload_to_cpu, with_grads))
        yield
        if writeback:
            for entry in gathered:
                entry.write_back()
    finally:
        for entry in gathered:
            entry.restore()
        for group in groups:
            _ACTIVE.discard(group)


def _groups(module: nn.Module, recurse: bool) -> list[FSDPParamGroup]:
    if not is_managed(module):
        raise TypeError(f"{type(module).__name__} is not sharded with shardkit's fully_shard")
    states = states_under(module) if recurse else [state_of(module)]
    return [g for s in states for g in s.groups]


def _check_usable(group: FSDPParamGroup, with_grads: bool) -> None:
    name = group.fqn or type(group.modules[0]).__name__
    if group.training_state is not TrainingState.IDLE:
        raise RuntimeError(
            f"full_params cannot be used in forward or backward: FSDP module {name} is in "
            f"{group.training_state.name}"
        )
    if group in _ACTIVE:
        raise RuntimeError(
            f"full_params: FSDP module {name} already has its full parameters registered "
            "(nested full_params on the same module)"
        )
    for p in group.params:
        if p.hooks is not None:
            raise NotImplementedError(
                f"full_params does not support parameters with all-gather hooks: {p.fqn} "
                f"of FSDP module {name}"
            )
        if with_grads and not isinstance(p.extension, DataParallelSharding):
            raise NotImplementedError(
                f"full_params(with_grads=True) does not support tensor-parallel parameters "
                f"yet: {p.fqn} of FSDP module {name}"
            )


@dataclass(slots=True)
class _Gathered:
    """One group's full parameters, registered on this rank (or not: ``full`` is empty)."""

    group: FSDPParamGroup
    full: dict[int, nn.Parameter]
    """Full parameter by index in the group, on the ranks that registered them."""

    def write_back(self) -> None:
        """Copy this rank's shard of each full parameter (as registered now) into its shard."""
        with torch.no_grad():
            for index, registered in self.full.items():
                p = self.group.params[index]
                current = read_slot(p.slots[0])
                value = current if current is not None else registered
                _write_shard(p, value)

    def restore(self) -> None:
        """Register the sharded parameters again."""
        for index in self.full:
            self.group.params[index].register(unsharded=False)


def _write_shard(p: FSDPParam, value: torch.Tensor) -> None:
    local = value.to_local() if isinstance(value, DTensor) else value
    shard_local = local_of(p.sharded_param)
    full = local.detach().to(shard_local.device, shard_local.dtype)
    shard_local.copy_(p.geometry.local_shard(full, p.mesh_info.shard_rank))


def _gather(
    group: FSDPParamGroup, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> _Gathered:
    plain = all(isinstance(p.extension, DataParallelSharding) for p in group.params)
    rows = gather_rows(group, to_all=not rank0_only, cpu=offload_to_cpu and plain)
    coordinator = coordinator_rank(group.params[0].sharding_spec.sharded_mesh)
    receives = rows is not None and (not rank0_only or global_rank() == coordinator)
    full: dict[int, nn.Parameter] = {}
    for index, p in enumerate(group.params):
        grad = _full_grad(p) if with_grads else None  # collective: every rank asks
        if rows is None or not receives:
            continue
        pieces = dp_pieces(group, index, rows)
        # A fresh tensor, never a view of the shards: edits reach them only by writeback.
        local = torch.cat(pieces).view(p.geometry.shape)
        if offload_to_cpu:
            local = local.cpu()
        param = nn.Parameter(
            p.extension.make_unsharded(local, p.sharding_spec), requires_grad=p.requires_grad
        )
        if grad is not None:
            param.grad = grad.cpu() if offload_to_cpu else grad
        full[index] = param
        for slot in p.slots:
            # A tied parameter gets the same full Parameter in each of its places.
            write_slot(slot, param, p.listed)
    return _Gathered(group, full)


def _full_grad(p: FSDPParam) -> torch.Tensor | None:
    grad = p.sharded_param.grad
    if grad is None:
        return None
    assert isinstance(grad, DTensor)
    full: torch.Tensor = grad.full_tensor()
    return full
