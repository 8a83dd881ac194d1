"""The checks and effects of ``FSDPModule``'s communication switches, on its groups.

``set_reduce_scatter_max_input_buffers``, ``set_all_reduce_hook``,
``set_custom_reduce_scatter``, ``set_custom_all_reduce``, ``set_reduce_precision`` and
``set_allocate_memory_from_process_group_for_comm``: each
checks every group it is given before it changes any, then sets the option on each. The
methods on ``FSDPModule`` choose the groups (``recurse``, or the module's own) and call these,
as its ``nn.Module`` overrides call ``module_overrides``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.reduce import check_policy
from shardkit.core.reduce_precision import ReducePrecision

__all__ = [
    "check_process_group_allocation",
    "set_all_reduce_hook",
    "set_custom_all_reduce",
    "set_custom_reduce_scatter",
    "set_max_input_buffers",
    "set_reduce_precision",
]


def set_max_input_buffers(groups: Sequence[FSDPParamGroup], max_input_buffers: int) -> None:
    """Up to ``max_input_buffers`` reductions in flight; a positive int, or TypeError/ValueError."""
    if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
        raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
    if max_input_buffers < 1:
        raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
    for group in groups:
        group.options.max_reduces_in_flight = max_input_buffers


def set_all_reduce_hook(
    groups: Sequence[FSDPParamGroup],
    hook: Callable[[torch.Tensor], None],
    stream: Any,
    owner: str,
) -> None:
    """The hook on the reduced gradient; a ``stream`` is refused on a native HSDP mesh."""
    for group in groups:
        info = group.mesh_info
        if stream is not None and info.replicate_group is not None and info.has_shard_axis:
            # torch's words alone (torch's own tests compare the whole message); the module
            # and its mesh go in a note, which the traceback shows.
            error = ValueError("stream cannot be set when using native HSDP")
            error.add_note(f"FSDP module {owner} is on a (replicate, shard) mesh")
            raise error
    for group in groups:
        group.options.all_reduce_hook = hook
        group.options.all_reduce_hook_stream = stream


def set_custom_reduce_scatter(groups: Sequence[FSDPParamGroup], comm: Any) -> None:
    """A user reduce-scatter, unless a group compresses its reduction."""
    setter = "set_custom_reduce_scatter" if comm is not None else None
    for group in groups:
        check_policy(group.options.reduce_precision, group, custom=setter)
    for group in groups:
        group.options.custom_reduce_scatter = comm


def set_custom_all_reduce(
    groups: Sequence[FSDPParamGroup],
    comm: Callable[[torch.Tensor, dist.ProcessGroup], None] | None,
    owner: str,
) -> None:
    """A user all-reduce across replicas, where a group has replicas and does not compress."""
    for group in groups:
        if comm is not None and group.mesh_info.replicate_group is None:
            raise ValueError(
                f"set_custom_all_reduce: FSDP module {group.fqn or owner} is "
                "sharded on a 1-D mesh, with no all-reduce across replicas to replace; use "
                "set_custom_reduce_scatter"
            )
        setter = "set_custom_all_reduce" if comm is not None else None
        check_policy(group.options.reduce_precision, group, custom=setter)
    for group in groups:
        group.options.custom_all_reduce = comm


def set_reduce_precision(groups: Sequence[FSDPParamGroup], policy: ReducePrecision | None) -> None:
    """The reduction's precision, every group checked before any changes."""
    for group in groups:
        check_policy(policy, group, custom=group.options.custom_collective())
    for group in groups:
        group.options.reduce_precision = policy


def check_process_group_allocation(groups: Sequence[FSDPParamGroup], module: str) -> None:
    """``set_allocate_memory_from_process_group_for_comm``: refused after a custom all-gather.

    Buffers from the process group's allocator are what a custom all-gather chooses itself, so
    torch's ``fully_shard`` refuses the switch once one is set, with an ``AssertionError``
    (its API's contract, which code written for it may catch); shardkit's buffers come from its
    own pool either way, so the switch changes nothing else.

    Raises:
        AssertionError: a group of ``module`` has a custom all-gather.
    """
    for group in groups:
        comm = group.options.custom_all_gather
        if comm is not None:
            raise AssertionError(
                f"{module}: cannot call set_allocate_memory_from_process_group_for_comm() when "
                f"the all-gather is custom ({type(comm).__name__}, set_custom_all_gather): the "
                "custom all-gather chooses its own buffers"
            )
