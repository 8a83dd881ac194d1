"""Runtime switches of one parameter group, set through FSDPModule methods."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardkit.core.reduce_precision import ReducePrecision
from shardkit.core.schedule import MAX_REDUCES_IN_FLIGHT

__all__ = ["GroupOptions"]


@dataclass(slots=True)
class GroupOptions:
    """Per-group switches that change between steps (gradient accumulation, prefetch...)."""

    reshard_after_forward: bool | int
    """True frees the full parameters after forward; False keeps them; an int n keeps a
    1/n slice so that backward gathers within n ranks only."""
    reshard_after_forward_is_default: bool = False
    """Set when the user passed None: the root then keeps its parameters after forward."""
    reshard_after_backward: bool = True
    """Free the full parameters after backward (False keeps them for the next microbatch)."""
    keep_unsharded_storage: bool = False
    """A reshard registers the sharded parameters but keeps the full parameters' memory, so
    their data pointers stay fixed across reshard and unshard (torch 2.15's, for CUDA graph
    capture), at the cost of that memory."""
    reduce_grads: bool = True
    """Reduce-scatter gradients after backward; False accumulates full gradients (no sync)."""
    all_reduce_grads: bool = True
    """HSDP: all-reduce across replicas after the reduce-scatter; False accumulates the
    partial result until a backward that does."""
    gradient_divide_factor: float | None = None
    """Divide summed gradients by this; None means the data-parallel world size."""
    force_sum_reduction: bool = False
    """Collectives only sum; the division runs as kernels of its own (``reduce/division``)."""
    unshard_in_backward: bool = True
    """Gather parameters before this group's backward (False if backward does not use them)."""
    reduce_scatter_unused_params: bool = False
    """Reduce trainable parameters that got no gradient as zeros (they then get a zero
    gradient); False leaves their gradient None, as torch does by default."""
    conditional: bool = False
    """The module may be skipped on some ranks, or run in another order than on others
    (``set_conditional``): the root issues its collectives (``engine/conditional``)."""
    is_last_backward: bool = True
    """False defers end-of-backward finalization (microbatching, pipeline schedules)."""
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    """Runs on each reduced gradient, after the HSDP all-reduce: divided by the collectives'
    mean, or not yet where the division runs after them (``reduce/division``)."""
    all_reduce_hook_stream: Any = None
    """The stream ``all_reduce_hook`` runs on (not with HSDP); None: the current stream."""
    max_reduces_in_flight: int = MAX_REDUCES_IN_FLIGHT
    """Reductions left in flight when this group's starts, before the oldest is finished
    (the schedule's driver finishes them: ``StepDriver.end_backward``)."""
    reduce_scatter_group: dist.ProcessGroup | None = None
    """A process group of its own for the reduce-scatter; None shares the shard group."""
    custom_all_gather: Any = None
    """A user all-gather (torch's ``AllGather``: ``allocate`` and ``__call__``), or None."""
    custom_reduce_scatter: Any = None
    """A user reduce-scatter (torch's ``ReduceScatter``), or None."""
    custom_all_reduce: Callable[[torch.Tensor, dist.ProcessGroup], None] | None = None
    """A user all-reduce across replicas, ``comm(tensor, group)``: a sum in place; or None."""
    reduce_precision: ReducePrecision | None = None
    """How gradients travel and are summed (``set_reduce_precision``); None: as torch."""
    unsynced_grads_in_param_dtype: bool = False
    """Without gradient sync, full gradients accumulate in the parameters' compute dtype
    (FSDP1's, autograd's own); False (torch's way) accumulates them in the reduce dtype
    (``GroupView.accumulate_unsynced_grads_in_param_dtype``)."""
    ends_at_last_grad: bool = False
    """Its backward ends at its count of gradients even where missing ones are reduced as
    zeros (FSDP1's flat parameter ends at its gradient hook; ``GroupView.end_at_last_grad``);
    False (the default) ends it where every rank's backward does (``schedule``)."""
    reduce_accumulated_grads: bool = False
    """No shard axis only (FSDP1's ``NO_SHARD``): a gradient already on a parameter joins the
    new one in the reduction, and the result replaces it; False (torch's way) reduces the
    new gradient alone and adds it to the one there (``GroupView.reduce_accumulated_grads``)."""
    forward_prefetch: list[Any] | None = None
    """Groups to gather right after this one's pre-forward (``set_modules_to_forward_prefetch``);
    None: the next in the previous step's forward order (``schedule``)."""
    backward_prefetch: list[Any] | None = None
    """Groups to gather right after this one's pre-backward
    (``set_modules_to_backward_prefetch``); None: the one before it in post-forward order."""

    def custom_collective(self) -> str | None:
        """The setter of the user collective this group reduces with, if any."""
        if self.custom_reduce_scatter is not None:
            return "set_custom_reduce_scatter"
        if self.custom_all_reduce is not None:
            return "set_custom_all_reduce"
        return None

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """The user's choice, which the root's lazy init then keeps."""
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_forward_is_default = False
