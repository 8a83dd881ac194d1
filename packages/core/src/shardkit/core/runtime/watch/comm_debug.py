"""torch's ``CommDebugMode`` counts the gloo exchanges as the collectives they stand for.

``CommDebugMode`` (``torch.distributed.tensor.debug``) counts the c10d collectives that pass
through torch's dispatcher, per module and per pass. On gloo the runtime carries out the
step's all-gathers and reduce-scatters as point-to-point exchanges (``runtime/collectives.py``
says why), which it does not count: a user who counts collectives on a laptop, or torch's own
tests that do, saw none where torch's ``fully_shard`` shows one per group and pass.

While such a mode is active, each exchange is also issued as its native collective on meta
tensors of the same shapes. The dispatcher hands it to the mode, which counts it where it runs
(the module, forward or backward), and then to c10d's meta kernel, which sends nothing. So the
wire is the same with or without the mode, and a mode entered on some ranks only changes
nothing for the others (a switch to the native collectives would leave them waiting).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from shardkit.core.runtime.flat_collectives import all_gather_single, reduce_scatter_single
from shardkit.core.runtime.reduction import Reduction

__all__ = ["count_all_gather", "count_all_to_all", "count_reduce_scatter"]


# Importing torch.distributed.tensor.debug imports torch._dynamo and torch._inductor (about
# 0.7 s of every process's start); the mode's class is looked up where the user imported it.
_DEBUG_PACKAGE = "torch.distributed.tensor.debug"


def _counting() -> bool:
    """Whether a ``CommDebugMode`` is active on this thread (cheap when no mode is)."""
    if torch._C._len_torch_dispatch_stack() == 0 or torch.compiler.is_compiling():
        return False
    # No process holds a CommDebugMode without having imported its package.
    mode_type = getattr(sys.modules.get(_DEBUG_PACKAGE), "CommDebugMode", None)
    if mode_type is None:
        return False
    return any(isinstance(mode, mode_type) for mode in _get_current_dispatch_mode_stack())


def _meta(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device="meta")


def count_all_gather(input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Show an active mode the exchange of ``input`` (one rank's row) as an all-gather."""
    if _counting():
        rows = _meta(group.size() * input.numel(), input.dtype)
        all_gather_single(rows, _meta(input.numel(), input.dtype), group=group)


def count_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: Reduction
) -> None:
    """Show an active mode the exchange of ``input``'s rows as a reduce-scatter into ``output``."""
    if _counting():
        summed = _meta(output.numel(), output.dtype)
        rows = _meta(input.numel(), input.dtype)
        reduce_scatter_single(summed, rows, op=op.torch_op(), group=group)


def count_all_to_all(rows: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Show an active mode the exchange of ``rows`` (row j to rank j) as an all-to-all.

    An all-to-all is what the same exchange is on the other backends.
    """
    if _counting():
        exchanged = _meta(rows.numel(), rows.dtype)
        dist.all_to_all_single(exchanged, _meta(rows.numel(), rows.dtype), group=group)
