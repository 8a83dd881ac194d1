"""FSDP1's ``register_comm_hook`` on the engine: the user's hook reduces every unit's gradients.

FSDP1 hands a sharded strategy's hook the unit's padded full gradient (W x S elements) and an
S-element output for this rank's shard, and divides nothing itself: the hook does (torch's
default hooks divide by the factors FSDP1's own path would). The engine's custom reduce-scatter
takes the same two buffers, so the hook runs there, with the engine's division off (a divide
factor of one). The rows are the engine's per-parameter shards (row r: rank r's shard of each
parameter) where FSDP1's are chunks of one flat parameter: a hook that treats the gradient
elementwise (casts, sums, scales: torch's hooks all do) reduces the same values into the same
places of each parameter; one that reads positions in the flat gradient sees another order.

``NO_SHARD`` (FSDP1's one-argument hook, an all-reduce) is refused, and so is a unit of one rank,
which FSDP1 runs as ``NO_SHARD``: the engine replicates such a unit with its own all-reduce (or
none), which has no place for a hook yet. Hybrid strategies are refused as FSDP1 refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.core import FSDPModule
from shardkit.legacy.mapping import STRATEGIES
from shardkit.legacy.units import unit_of, units_in

__all__ = ["CommHookReduceScatter", "register_comm_hook"]


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


def register_comm_hook(root: nn.Module, state: object, hook: Callable[..., Any]) -> None:
    """Reduce the gradients of every unit under ``root`` with ``hook`` (FSDP1's rules).

    Every unit is checked before any changes.

    Raises:
        AssertionError: ``root`` is not the root wrapper, a unit is hybrid or already has a
            hook (FSDP1's errors and messages).
        ValueError: ``hook`` is not callable.
        NotImplementedError: a unit is ``NO_SHARD`` or of one rank.
    """
    units = [unit_of(w) for w in units_in(root)]
    for unit in units:
        strategy = unit.unit.strategy
        mesh = STRATEGIES[strategy].mesh
        if mesh == "hybrid":
            raise AssertionError(
                f"Communication hook is not supported for hybrid strategies: {strategy}"
            )
        if unit.comm_hook is not None:
            raise AssertionError("A communication hook is already registered")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook}")
        if mesh == "replicate" or unit.unit.process_group.size() == 1:
            raise NotImplementedError(
                "register_comm_hook with ShardingStrategy.NO_SHARD (which FSDP1 also makes of a "
                "unit of one rank) is not supported by shardkit.legacy: the engine's all-reduce "
                "of a replicated unit takes no hook; the sharded strategies (FULL_SHARD, "
                "SHARD_GRAD_OP) over more than one rank are"
            )
    comm = CommHookReduceScatter(state, hook)
    for unit in units:
        unit.comm_hook = comm
    # Every unit gets the same hook, so every engine module under the root takes it (a unit
    # that wraps a container shards the modules inside it).
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(comm)
            module.set_gradient_divide_factor(1.0)
