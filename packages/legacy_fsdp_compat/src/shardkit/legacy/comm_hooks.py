"""FSDP1's ``register_comm_hook`` on the engine: the user's hook reduces every unit's gradients.

FSDP1 hands a sharded strategy's hook the unit's padded full gradient (W x S elements) and an
S-element output for this rank's shard, and divides nothing itself: the hook does (torch's
default hooks divide by the factors FSDP1's own path would). The engine's custom reduce-scatter
takes the same two buffers, so the hook runs there, with the engine's division off (a divide
factor of one). The rows are the engine's per-parameter shards (row r: rank r's shard of each
parameter) where FSDP1's are chunks of one flat parameter: a hook that treats the gradient
elementwise (casts, sums, scales: torch's hooks all do) reduces the same values into the same
places of each parameter; one that reads positions in the flat gradient sees another order.

``NO_SHARD`` (and a unit of one rank, which FSDP1 and this package run as ``NO_SHARD``) hands
the hook the unit's whole gradient, ``hook(state, grad)``, to all-reduce in place: it runs as the
engine's custom all-reduce across the unit's replicas, again with the engine's division off.
Hybrid strategies are refused as FSDP1 refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.core import FSDPModule
from shardkit.legacy.mapping import STRATEGIES
from shardkit.legacy.units import is_unit, unit_of, units_in

__all__ = ["CommHookAllReduce", "CommHookReduceScatter", "register_comm_hook"]


class CommHookReduceScatter:
    """FSDP1's ``hook(state, grad, output)`` in the shape of the engine's custom reduce-scatter."""

    def __init__(self, state: object, hook: Callable[..., Any]) -> None:
        self.state = state
        self.hook = hook

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The engine's own kind of buffer: the hook brings no memory of its own."""
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        op: object = None,
        async_op: bool = False,
    ) -> None:
        """Run the hook on ``input`` (W x S, flat) into ``output`` (S), synchronously.

        The hook's own process group and division stand (``group`` and ``op`` are the
        engine's, which FSDP1 never passes). torch's low-precision hooks rebind ``.data`` to
        a cast copy: the hook gets tensors of its own over the engine's buffers, and a result
        left in another storage is copied back.
        """
        grad, out = input.detach(), output.detach()
        self.hook(self.state, grad, out)
        if out.untyped_storage().data_ptr() != output.untyped_storage().data_ptr():
            output.copy_(out)


class CommHookAllReduce:
    """FSDP1's ``NO_SHARD`` hook, ``hook(state, grad)``, as the engine's custom all-reduce."""

    def __init__(self, state: object, hook: Callable[..., Any]) -> None:
        self.state = state
        self.hook = hook

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Run the hook on the unit's whole gradient, in place (its own process group stands)."""
        grad = tensor.detach()  # a rebinding of ``.data`` stays the hook's
        self.hook(self.state, grad)
        if grad.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
            tensor.copy_(grad)


def register_comm_hook(root: nn.Module, state: object, hook: Callable[..., Any]) -> None:
    """Reduce the gradients of every unit under ``root`` with ``hook`` (FSDP1's rules).

    Every unit is checked before any changes. A sharded unit calls ``hook(state, grad,
    output)``; a ``NO_SHARD`` one (a unit of one rank is one) calls ``hook(state, grad)``.

    Raises:
        AssertionError: ``root`` is not the root wrapper, a unit is hybrid or already has a
            hook (FSDP1's errors and messages).
        ValueError: ``hook`` is not callable.
    """
    units = units_in(root)
    for wrapper in units:
        unit = unit_of(wrapper)
        strategy = unit.unit.strategy
        if STRATEGIES[strategy].mesh == "hybrid":
            raise AssertionError(
                f"Communication hook is not supported for hybrid strategies: {strategy}"
            )
        if unit.comm_hook is not None:
            raise AssertionError("A communication hook is already registered")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook}")
    scatter = CommHookReduceScatter(state, hook)
    replicated = CommHookAllReduce(state, hook)
    for wrapper in units:
        unit = unit_of(wrapper)
        no_shard = STRATEGIES[unit.unit.strategy].mesh == "replicate"
        unit.comm_hook = replicated if no_shard else scatter
        for module in _engine_modules(unit.module):
            if no_shard:
                module.set_custom_all_reduce(replicated)
            else:
                module.set_custom_reduce_scatter(scatter)
            module.set_gradient_divide_factor(1.0)


def _engine_modules(wrapped: nn.Module) -> list[FSDPModule]:
    """The engine modules of one unit: those in its tree that no inner unit holds.

    A unit that wraps a container shards the modules inside it, so there may be several.
    """
    found: list[FSDPModule] = []
    queue = [wrapped]
    while queue:
        module = queue.pop()
        if isinstance(module, FSDPModule):
            found.append(module)
        queue.extend(child for child in module.children() if not is_unit(child))
    return found
