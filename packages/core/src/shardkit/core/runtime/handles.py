"""Handles of collectives in flight: what ``ProcessGroupRuntime`` returns, and their waits.

A handle's ``wait()`` blocks until its collective's output may be read (on CUDA, the current
stream waits), recording the wait for the hang watch and, with desync checks, comparing the
collective's fingerprints first. Nothing here issues a collective: ``collectives`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.runtime.pool import BufferPool
from shardkit.core.runtime.protocol import RowBlock
from shardkit.core.runtime.reduction import SUM, Reduction
from shardkit.core.runtime.ring_order import ring_fold_order, ring_owners
from shardkit.core.runtime.watch import desync, stuck
from shardkit.core.runtime.watch.lifetimes import Flight
from shardkit.core.runtime.watch.progress import PROGRESS, CollectiveInfo

__all__ = ["DoneHandle", "GatherHandle", "SumRowsHandle", "WorkHandle", "wait_all"]


class DoneHandle:
    """A handle for work that already finished (world size 1, or nothing to do)."""

    def wait(self) -> None:
        """Nothing to wait for."""


def wait_all(
    works: Sequence[dist.Work | None],
    info: CollectiveInfo | None,
    check: desync.PendingCheck | None = None,
    flight: Flight | None = None,
) -> None:
    """Wait for ``works``, recorded as a wait on ``info`` for the hang watch.

    A wait that the stuck check broke raises its
    :class:`~shardkit.core.errors.StuckCollectiveError` (``runtime/watch/stuck.py``).

    With desync checks, the fingerprints of ``check`` are compared first (raises if they differ).
    With lifetime checks, ``flight`` (the memory the works use) is checked before the wait
    and released from the records after it.
    """
    if check is not None:
        check.settle()
    if flight is not None:
        flight.landing()
    if info is not None:
        PROGRESS.begin_wait(info, works)
    try:
        for work in works:
            if work is not None:
                work.wait()
    except RuntimeError as error:  # gloo's, or the stuck check's break of a wait past its bound
        stuck.raise_if_stuck(error)
        raise
    finally:
        if info is not None:
            PROGRESS.end_wait()
    if flight is not None:
        flight.landed()


@dataclass(slots=True)
class WorkHandle:
    """Wraps a c10d ``Work``; waits at most once."""

    work: dist.Work | None
    info: CollectiveInfo | None = None
    flight: Flight | None = None  # with lifetime checks: the memory the work uses

    def wait(self) -> None:
        """Block until the collective is done."""
        if self.work is not None or self.flight is not None:
            wait_all([self.work], self.info, flight=self.flight)
            self.work = self.flight = None


@dataclass(slots=True)
class SumRowsHandle:
    """Reduce-scatter by exchanging rows: after the exchange, add the other ranks' rows.

    In gloo's order (``ring_order``): the result is bit for bit gloo's own reduce-scatter, the
    one torch's ``fully_shard`` runs on CPU. One addition per rank and per span of columns
    (one span where the row's bytes split evenly into gloo's segments, at most three).
    """

    works: list[dist.Work]
    own: torch.Tensor  # (S,): this rank's own row of the input, never sent
    received: torch.Tensor  # (W-1, S): the other ranks' rows for this rank's shard, in rank order
    output: torch.Tensor  # (S,); at W=2 ``received`` is ``output`` itself
    scratch: torch.Tensor | None  # the pool buffer behind ``received`` (W > 2)
    pool: BufferPool
    rank: int
    op: Reduction = SUM  # what the sum becomes (a mean: divided by W)
    info: CollectiveInfo | None = None
    check: desync.PendingCheck | None = None  # compared before the rows are summed
    flight: Flight | None = None  # with lifetime checks: the memory the exchange uses

    def wait(self) -> None:
        """Wait for the exchange, then sum into ``output`` (once)."""
        if not self.works:
            return
        wait_all(self.works, self.info, self.check, self.flight)
        self.works, self.flight = [], None
        world = self.received.size(0) + 1
        if self.scratch is None:
            self.output.add_(self.own)  # received straight into the output (W == 2)
        else:
            rows = [*self.received[: self.rank], self.own, *self.received[self.rank :]]
            spans = ring_owners(self.output.numel(), self.rank, world, self.output.element_size())
            for start, stop, owner in spans:
                # One span (rows that split evenly: the usual case) needs no slicing views.
                whole = len(spans) == 1
                out = self.output if whole else self.output[start:stop]
                part = rows if whole else [r[start:stop] for r in rows]
                first, second, *rest = ring_fold_order(owner, world)
                torch.add(part[first], part[second], out=out)
                for j in rest:
                    out.add_(part[j])
            self.pool.put(self.scratch)
        self.op.finish_sum(self.output, world)


@dataclass(slots=True)
class GatherHandle:
    """An all-gather in flight; ``wait()`` returns every rank's row, as blocks in rank order."""

    works: list[dist.Work]
    blocks: list[RowBlock]  # uint8 rows of N bytes; this rank's own row may be its input
    buffer: torch.Tensor | None  # the pool buffer behind the other ranks' rows
    pool: BufferPool
    info: CollectiveInfo | None = None
    check: desync.PendingCheck | None = None  # compared before the rows are returned
    flight: Flight | None = None  # with lifetime checks: the memory the gather uses

    def wait(self) -> list[RowBlock]:
        """Block until every row has arrived; returns the rows."""
        if self.works or self.flight is not None:
            wait_all(self.works, self.info, self.check, self.flight)
        self.works, self.flight = [], None
        return self.blocks

    def release(self) -> None:
        """Give the receive buffer back (after the rows were copied out)."""
        if self.buffer is not None:
            self.pool.put(self.buffer)
            self.buffer = None
