"""The collective runtime: the only module that calls ``torch.distributed`` collectives.

Collectives are issued asynchronously and return handles; ``wait()`` comes right before the
output is used. On gloo, a reduce-scatter is carried out as an all-to-all plus a local sum,
because gloo's own reduce-scatter sends twice the minimum bytes (it runs as an all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core import observe
from shardkit.core.runtime.pool import BufferPool

__all__ = ["DoneHandle", "ProcessGroupRuntime", "WorkHandle"]


class DoneHandle:
    """A handle for work that already finished (world size 1, or nothing to do)."""

    def wait(self) -> None:
        """Nothing to wait for."""


@dataclass(slots=True)
class WorkHandle:
    """Wraps a c10d ``Work``; waits at most once."""

    work: dist.Work | None

    def wait(self) -> None:
        """Block until the collective is done."""
        if self.work is not None:
            self.work.wait()
            self.work = None


@dataclass(slots=True)
class _SumRowsHandle:
    """Reduce-scatter via all-to-all: after the exchange, sum the received rows."""

    work: dist.Work | None
    received: torch.Tensor  # (W, S): row j is rank j's contribution to this rank's shard
    output: torch.Tensor  # (S,)
    scratch: torch.Tensor  # the pool buffer behind ``received``
    pool: BufferPool

    def wait(self) -> None:
        """Wait for the exchange, then sum the rows into ``output`` (once)."""
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        rows = self.received
        if rows.size(0) == 2:
            torch.add(rows[0], rows[1], out=self.output)
        else:
            torch.sum(rows, dim=0, out=self.output)
        self.pool.put(self.scratch)


def _uses_gloo(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


class ProcessGroupRuntime:
    """Collectives on c10d process groups (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, pool: BufferPool | None = None) -> None:
        self.pool = pool if pool is not None else BufferPool()

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
    ) -> WorkHandle | DoneHandle:
        """Gather ``input`` from every rank into ``output`` (rank-major), asynchronously."""
        size = group.size()
        if observe.has_subscribers():
            nbytes = input.numel() * input.element_size()
            observe.emit(
                observe.CollectiveEvent("all_gather", size, nbytes, nbytes * (size - 1), "ring")
            )
        if size == 1:
            output.copy_(input)
            return DoneHandle()
        return WorkHandle(dist.all_gather_single(output, input, group=group, async_op=True))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
    ) -> WorkHandle | DoneHandle | _SumRowsHandle:
        """Sum row r of ``input`` (W, S) over the group into ``output`` (S) on rank r."""
        size = group.size()
        gloo = size > 1 and _uses_gloo(group)
        if observe.has_subscribers():
            row_bytes = output.numel() * output.element_size()
            observe.emit(
                observe.CollectiveEvent(
                    "reduce_scatter",
                    size,
                    row_bytes * size,
                    row_bytes * (size - 1),
                    "all_to_all+sum" if gloo else "native",
                )
            )
        if size == 1:
            output.copy_(input[0])
            return DoneHandle()
        if gloo:
            scratch = self.pool.get(input.numel() * input.element_size(), input.device)
            received = scratch.view(input.dtype).view(input.shape)
            work = dist.all_to_all_single(received, input, group=group, async_op=True)
            return _SumRowsHandle(work, received, output, scratch, self.pool)
        return WorkHandle(
            dist.reduce_scatter_single(
                output, input.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True
            )
        )

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> WorkHandle | DoneHandle:
        """Sum ``tensor`` over ``group`` in place, asynchronously."""
        size = group.size()
        if observe.has_subscribers():
            nbytes = tensor.numel() * tensor.element_size()
            observe.emit(
                observe.CollectiveEvent(
                    "all_reduce", size, nbytes, 2 * nbytes * (size - 1) // max(size, 1), "ring"
                )
            )
        if size == 1:
            return DoneHandle()
        return WorkHandle(dist.all_reduce(tensor, group=group, async_op=True))
