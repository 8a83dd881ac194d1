"""The collective runtime: the only module that calls ``torch.distributed`` collectives.

Collectives are issued asynchronously and return handles; ``wait()`` comes right before the
output is used. On gloo, a reduce-scatter is carried out as an exchange of rows plus a local sum,
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
    """Reduce-scatter by exchanging rows: after the exchange, add the other ranks' rows."""

    works: list[dist.Work]
    own: torch.Tensor  # (S,): this rank's own row of the input, never sent
    received: torch.Tensor  # (W-1, S): the other ranks' rows for this rank's shard
    output: torch.Tensor  # (S,); at W=2 ``received`` is ``output`` itself
    scratch: torch.Tensor | None  # the pool buffer behind ``received`` (W > 2)
    pool: BufferPool

    def wait(self) -> None:
        """Wait for the exchange, then sum into ``output`` (once)."""
        if not self.works:
            return
        for work in self.works:
            work.wait()
        self.works = []
        if self.scratch is None:
            self.output.add_(self.own)  # received straight into the output (W == 2)
            return
        torch.add(self.own, self.received.sum(dim=0), out=self.output)
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
                    "exchange+sum" if gloo else "native",
                )
            )
        if size == 1:
            output.copy_(input[0])
            return DoneHandle()
        if gloo:
            return self._reduce_scatter_by_exchange(output, input, group)
        return WorkHandle(
            dist.reduce_scatter_single(
                output, input.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True
            )
        )

    def _reduce_scatter_by_exchange(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
    ) -> _SumRowsHandle:
        # Row j of ``input`` goes to rank j and rank j's row for us comes back: the bytes of an
        # all-to-all, but a rank's own row stays put, so only W-1 rows are received. At W=2
        # the one received row lands in ``output`` directly: no scratch buffer at all.
        size, rank = group.size(), group.rank()
        row = input.size(1)
        scratch: torch.Tensor | None = None
        if size == 2:
            received = output.view(1, row)
        else:
            scratch = self.pool.get((size - 1) * row * input.element_size(), input.device)
            received = scratch.view(input.dtype).view(size - 1, row)
        works: list[dist.Work] = []
        peers = [j for j in range(size) if j != rank]
        for slot, peer in enumerate(peers):
            recv = dist.irecv(received[slot], group=group, group_src=peer)
            send = dist.isend(input[peer], group=group, group_dst=peer)
            works += [w for w in (recv, send) if w is not None]
        return _SumRowsHandle(works, input[rank], received, output, scratch, self.pool)

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
