"""The collectives shardkit.legacy runs itself, outside the core's training path.

FSDP1 features the core has no counterpart for (``sync_module_states``, the gradient norm of
``clip_grad_norm_``, optimizer state scattered from rank 0) issue their few collectives
here, so every collective of this package is in one file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = [
    "all_reduce",
    "all_to_all",
    "broadcast",
    "broadcast_from_first",
    "broadcast_object",
    "first_error",
    "gather_objects",
    "group_rank",
    "group_size",
    "mesh_ranks_group",
    "raise_alike",
]

# Error types a rank raises as the failed rank's own; any other becomes a RuntimeError
# naming it. Each takes its message as its one argument.
_ALIKE: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (KeyError, ValueError, TypeError, RuntimeError)
}


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This rank's index in ``group`` (default: the world)."""
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (default: the world)."""
    return dist.get_world_size(group)


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """The group's first rank's values of ``tensors`` on every rank of ``group``, in place.

    Tensors of one dtype and device travel in one flat message, as FSDP1 coalesces them.
    A DTensor (a tensor-parallel parameter) sends its local tensor: the group is a
    data-parallel axis, whose ranks hold the same pieces of it.
    """
    if group.size() == 1:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        buckets.setdefault((local.dtype, local.device), []).append(local)
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


def gather_objects(value: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank of ``group``'s ``value`` (picklable), in rank order, on every rank."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [value]
    gathered: list[object] = [None] * size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def all_to_all(
    send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Each rank's ``send_sizes[r]`` elements of ``send`` to rank ``r`` of ``group``, in order.

    Returns:
        1-D: what every rank sent this one, in rank order (``recv_sizes`` elements each).
    """
    received = send.new_empty(sum(recv_sizes))
    if group.size() > 1:
        dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group)
    return received


def mesh_ranks_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """A group of every rank of ``mesh``, the ranks that call into a model sharded over it.

    None is the world: a mesh over every rank, or a 2-D (hybrid) mesh over some of them, for
    which no one group exists (those calls must then be made by every rank of the world).
    A mesh with one axis only of more than one rank (``NO_SHARD``'s (N, 1)) is that axis.
    """
    if mesh.size() == dist.get_world_size():
        return None
    wide = [dim for dim in range(mesh.ndim) if mesh.size(dim) > 1]
    if mesh.ndim == 1 or len(wide) <= 1:
        return mesh.get_group(wide[0] if wide else 0)
    return None


def first_error(message: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """The first failed rank's error message among the ranks of ``group`` (None: none failed).

    Every rank of ``group`` (default: the world) calls it, so that ranks whose own checks
    passed raise too instead of going on to a collective that the failed ranks never enter.
    Ranks are named by their global rank.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return message
    messages: list[str | None] = [None] * size
    dist.all_gather_object(messages, message, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    failed = ((r, m) for r, m in zip(ranks, messages, strict=True) if m is not None)
    return next((f"rank {r}: {m}" for r, m in failed), None)


def raise_alike(error: Exception | None, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank of ``group`` if ``error`` is set on any of them; else return.

    Every rank of ``group`` (default: the world) calls it after the same checks, passing what
    its own raised (None: they passed), so that no rank goes on to a collective the failed
    ranks never enter. Where every rank failed alike, each raises its own error; otherwise
    each raises the first failed rank's, of the same type (one of ``KeyError``,
    ``ValueError``, ``TypeError``, ``RuntimeError``; any other becomes a ``RuntimeError``
    naming it), its message naming that rank by its global rank.
    """
    mine = None
    if error is not None:
        # A KeyError's str() quotes its message; its argument is the message itself.
        words = error.args[0] if isinstance(error, KeyError) and error.args else error
        mine = (type(error).__name__, str(words))
    everyone = gather_objects(mine, group)
    failed = [(rank, e) for rank, e in enumerate(everyone) if e is not None]
    if not failed:
        return
    if error is not None and all(e == mine for e in everyone):
        raise error
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    assert failed[0][1] is not None
    index, (kind, message) = cast(tuple[int, tuple[str, str]], failed[0])
    rank = ranks[index] if ranks is not None else index
    cls = _ALIKE.get(kind)
    text = f"rank {rank}: {message}" if cls is not None else f"rank {rank}: {kind}: {message}"
    raise (cls or RuntimeError)(text) from error
