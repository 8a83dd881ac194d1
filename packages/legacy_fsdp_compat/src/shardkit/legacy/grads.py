"""``clip_grad_norm_``: FSDP1's gradient clipping over sharded and replicated gradients.

Each rank holds a shard of every sharded gradient: its local norms are summed (p-th powers)
or maxed over the process group, as FSDP1 does; gradients that every rank holds whole
(``NO_SHARD``, ignored parameters) are counted once, locally.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.legacy.comm import all_reduce
from shardkit.legacy.flat_params import per_parameter_view
from shardkit.legacy.sharded_state_dict import is_sharded
from shardkit.legacy.torch_compat import foreach_mul_, foreach_norm
from shardkit.legacy.units import unit_of

__all__ = ["clip_grad_norm"]


@torch.no_grad()
def clip_grad_norm(root: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip every gradient of ``root`` so that their total norm is at most ``max_norm``.

    Returns:
        The total norm before clipping, in the gradients' promoted dtype.
    """
    unit = unit_of(root).unit
    sharded: list[torch.Tensor] = []
    whole: list[torch.Tensor] = []
    with per_parameter_view():  # the flat parameters' gradients view these (flat_params)
        params = list(root.parameters())
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            (sharded if is_sharded(grad) else whole).append(grad.to_local())
        else:
            whole.append(grad)
    zero = torch.tensor(0.0, device=unit.device)
    local_sharded = _norm(sharded, norm_type, zero)
    local_whole = _norm(whole, norm_type, zero) if whole else None
    if not sharded:
        total = local_whole if local_whole is not None else zero
    elif norm_type == math.inf:
        total = local_sharded if local_whole is None else torch.maximum(local_sharded, local_whole)
        all_reduce(total, unit.process_group, dist.ReduceOp.MAX)
    else:
        total = local_sharded**norm_type
        all_reduce(total, unit.process_group, dist.ReduceOp.SUM)
        if local_whole is not None:
            total = total + local_whole**norm_type
        total = total ** (1.0 / norm_type)
    if unit.cpu_offload.offload_params:
        total = total.cpu()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = sharded + whole
    _scale(grads, coefficient)
    if not grads:
        return total
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))


def _norm(grads: list[torch.Tensor], norm_type: float, zero: torch.Tensor) -> torch.Tensor:
    # FSDP1's arithmetic: each gradient's norm in float32, then the norm of those norms.
    if not grads:
        return zero
    total: torch.Tensor = torch.linalg.vector_norm(
        torch.stack(_norms(grads, norm_type)), norm_type, dtype=torch.float32
    )
    return total.to(zero.device)


def _norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each gradient's norm in float32, as ``torch.linalg.vector_norm`` gives it (bit for bit)."""
    # On the CPU torch's foreach norm runs vector_norm per tensor, in one dispatch instead of
    # one per gradient. Its fused CUDA kernel sums in another order: there the last bits
    # could differ from FSDP1's per-gradient norms, so other devices keep vector_norm.
    if all(g.device.type == "cpu" for g in grads):
        return foreach_norm(grads, norm_type)
    return [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]


def _scale(grads: list[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply every gradient by ``coefficient`` cast to its dtype first, as FSDP1 does."""
    # One foreach multiply per (device, dtype) with one coefficient conversion each, rather
    # than a conversion and a mul_ per gradient: an elementwise product rounds the same.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), group in groups.items():
        foreach_mul_(group, coefficient.to(device, dtype))
