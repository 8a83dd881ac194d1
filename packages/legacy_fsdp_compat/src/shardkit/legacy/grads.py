"""``clip_grad_norm_``: FSDP1's gradient clipping over sharded and replicated gradients.

Each rank holds a shard of every sharded gradient: its local norms are summed (p-th powers)
or maxed over the process group, as FSDP1 does; gradients that every rank holds whole
(``NO_SHARD``, ignored parameters) are counted once, locally. FSDP1 takes one norm per
parameter it sees: a flat parameter's is the norm of the unit's whole flat gradient, so a
``NO_SHARD`` unit with flat parameters is normed as one tensor of its gradients in FSDP1's
flat order (the same bits; sharded units' flat chunks hold other elements than the engine's
shards, so there only the sum is FSDP1's, not its rounding).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.legacy.comm import all_reduce
from shardkit.legacy.configs import ShardingStrategy
from shardkit.legacy.flat_params import per_parameter_view
from shardkit.legacy.sharded_state_dict import is_sharded
from shardkit.legacy.torch_compat import foreach_mul_, foreach_norm
from shardkit.legacy.units import unit_of, units_in

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
    normed_whole: list[torch.Tensor] = []  # whole, a flat NO_SHARD unit's as one tensor
    with per_parameter_view():  # the flat parameters' gradients view these (flat_params)
        params = list(root.parameters())
        flat_whole, in_flat = _flat_no_shard_grads(root)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if isinstance(grad, DTensor) and is_sharded(grad):
            sharded.append(local)
            continue
        whole.append(local)
        if id(param) not in in_flat:
            normed_whole.append(local)
    normed_whole += flat_whole
    zero = torch.tensor(0.0, device=unit.device)
    local_sharded = _norm(sharded, norm_type, zero)
    local_whole = _norm(normed_whole, norm_type, zero) if normed_whole else None
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


def _flat_no_shard_grads(root: nn.Module) -> tuple[list[torch.Tensor], set[int]]:
    """FSDP1's flat gradient of each ``NO_SHARD`` unit with flat parameters under ``root``.

    Returns the flat gradients (each unit's gradients in FSDP1's flat order, one tensor, zeros
    for a parameter without one; none for a unit without any) and the ids of the parameters
    whose gradients they stand for. Call inside ``per_parameter_view``.
    """
    flats: list[torch.Tensor] = []
    covered: set[int] = set()
    for wrapper in units_in(root):
        state = unit_of(wrapper)
        if state.flat is None or state.unit.strategy is not ShardingStrategy.NO_SHARD:
            continue
        mine = {id(p) for p in state.flat.originals}
        ordered = [p for p in dict.fromkeys(state.module.parameters()) if id(p) in mine]
        grads = [p.grad for p in ordered]
        if all(g is None for g in grads):
            continue
        pieces = []
        for param, grad in zip(ordered, grads, strict=True):
            if grad is None:
                pieces.append(torch.zeros(param.numel(), dtype=param.dtype, device=param.device))
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            covered.add(id(param))
            pieces.append(local.reshape(-1))
        flats.append(torch.cat(pieces))
    return flats, covered


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
