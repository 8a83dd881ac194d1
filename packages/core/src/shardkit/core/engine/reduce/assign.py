"""A reduced shard made the parameters' gradients: the cast, the offload copy, the assignment.

The reduction's result is in the reduce dtype, on the device. Each parameter's gradient is a
view of it at the parameter's offset (or is added to the gradient already there), after one
cast to the parameters' dtype for the whole group and, with CPU offload, one copy to the
host. See [Note: gpu schedule] (CPU offload).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.reduce.packing import Packing
from shardkit.core.runtime.dtensors import accumulate_grads, has_post_accumulate_grad_hooks

__all__ = ["assign_local", "assign_reduced", "take_sharded_grad"]


def assign_reduced(
    reduced: torch.Tensor,
    packing: Packing,
    comm: CommContext,
    *,
    offload: bool,
    pin_memory: bool,
) -> None:
    """Assign ``reduced`` (S,), laid out as ``packing``, as its parameters' sharded gradients.

    ``offload``: the shards live on the host, and so must their gradients (``pin_memory``:
    in pinned memory, which a copy can fill without blocking).
    """
    # Each gradient in its parameter's dtype, or the grad_dtype its user set (None: as reduced).
    wanted = [p.sharded_grad_dtype or reduced.dtype for p in packing.params]
    dtypes = set(wanted)
    if len(dtypes) == 1 and reduced.dtype not in dtypes:
        reduced = reduced.to(dtypes.pop())  # one cast for the whole group
    if offload:
        # Into pinned memory without blocking only if nothing on the host reads the copy
        # before backward's end waits for it. See [Note: gpu schedule] (CPU offload).
        overlap = pin_memory and not _read_on_host(packing, reduced.dtype)
        reduced = comm.host_copies.to_host(reduced, non_blocking=overlap)
    for p, offset, dtype in zip(packing.params, packing.offsets, wanted, strict=True):
        local = p.local_at(reduced, offset)
        if local.dtype != dtype:
            local = local.to(dtype)
        assign_local(p, local)


def assign_local(p: FSDPParam, local: torch.Tensor) -> None:
    """Give ``p``'s sharded parameter the gradient ``local`` (its shard), or add it."""
    accumulate_grads(((p.sharded_param, local),))


def take_sharded_grad(p: FSDPParam) -> torch.Tensor | None:
    """The gradient on ``p``'s sharded parameter as a local tensor of its full shape, taken off.

    For a group without a shard axis (FSDP1's ``NO_SHARD``), whose next gradient is to be
    the sum of this one and what comes: the local tensor is the whole gradient there.
    """
    grad = p.sharded_param.grad
    if grad is None:
        return None
    p.sharded_param.grad = None
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    return local.reshape(p.geometry.shape)


def _read_on_host(packing: Packing, dtype: torch.dtype) -> bool:
    """Whether assigning ``packing``'s gradients (of ``dtype``) reads them on the host at once.

    Adding to a gradient there, casting to a parameter's dtype, and hooks that run once a
    gradient is assigned (optimizer-in-backward) all do.
    """
    return any(
        (p.sharded_grad_dtype or dtype) != dtype
        or p.sharded_param.grad is not None
        or has_post_accumulate_grad_hooks(p.sharded_param)
        for p in packing.params
    )
