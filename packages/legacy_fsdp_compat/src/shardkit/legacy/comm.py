"""The collectives shardkit.legacy runs itself, outside the core's training path.

FSDP1 features the core has no counterpart for (``sync_module_states``, the gradient norm of
``clip_grad_norm_``, optimizer state scattered from rank 0) issue their few collectives
here, so every collective of this package is in one file.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce",
    "broadcast",
    "broadcast_from_first",
    "broadcast_object",
    "group_rank",
    "group_size",
]


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This rank's index in ``group`` (default: the world)."""
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (default: the world)."""
    return dist.get_world_size(group)


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """The group's first rank's values of ``tensors`` on every rank of ``group``, in place.

    Tensors of one dtype and device travel in one flat message, as FSDP1 coalesces them.
    """
    if group.size() == 1:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for bucket in buckets.values():
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat, group=group, group_src=0)
        offset = 0
        with torch.no_grad():
            for tensor in bucket:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType) -> None:
    """Reduce ``tensor`` over ``group`` in place (sum or max)."""
    if group.size() > 1:
        dist.all_reduce(tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """The first rank of ``group``'s ``tensor`` on every rank (default: the world), in place."""
    if dist.get_world_size(group) > 1:
        dist.broadcast(tensor, group=group, group_src=0)


def broadcast_object(value: object, group: dist.ProcessGroup | None = None) -> object:
    """The first rank of ``group``'s ``value`` (picklable) on every rank."""
    holder = [value]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(holder, group=group, group_src=0)
    return holder[0]
