"""The boundary between parameter groups and the collective runtime.

Parameter groups call only this protocol; the runtime knows nothing about modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardkit.core.runtime.pool import BufferPool
from shardkit.core.runtime.reduction import SUM, Reduction

__all__ = [
    "CollectiveHandle",
    "CollectiveRuntime",
    "CustomComm",
    "GatheredRows",
    "RowBlock",
    "rows_of",
]


class CollectiveHandle(Protocol):
    """An issued collective. ``wait()`` blocks until its output may be read."""

    def wait(self) -> None:
        """Block until the collective's output is ready (idempotent)."""


@dataclass(frozen=True, slots=True)
class RowBlock:
    """The gathered rows of consecutive ranks, as one tensor.

    A native all-gather lands every rank's row in one buffer: one block. An exchange keeps
    this rank's own row where it was (its gather input) and receives the others into one
    buffer: up to three blocks. Copying out one block at a time keeps the number of copies a
    group launches independent of the world size. See [Note: flat group buffers].
    """

    first: int
    """The rank of the block's first row."""
    rows: torch.Tensor
    """(k, N) uint8: the rows of ranks ``first`` to ``first + k - 1``."""


def rows_of(blocks: Sequence[RowBlock]) -> list[torch.Tensor]:
    """Every rank's row (N bytes), in rank order: one view per rank, for rare paths only."""
    return [row for block in blocks for row in block.rows.unbind(0)]


class GatheredRows(Protocol):
    """An all-gather in flight."""

    def wait(self) -> Sequence[RowBlock]:
        """Block until done; returns the W rows (N bytes each) as blocks in rank order."""

    def release(self) -> None:
        """Return the buffers behind the rows once they were copied out."""


class CustomComm(Protocol):
    """A user collective in the shape of torch's ``AllGather`` / ``ReduceScatter``."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A buffer for the collective (the user chooses where its memory comes from)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        """Run the collective: ``(output, input, group[, op], async_op=...)``."""


class CollectiveRuntime(Protocol):
    """Issues collectives on flat buffers and returns handles."""

    pool: BufferPool
    """The buffers the runtime and the groups share (receive and send buffers)."""

    # ``label``: the module the collective serves, passed on to observers (CollectiveEvent).

    def gather_buffer(
        self, nbytes: int, group: dist.ProcessGroup, device: torch.device
    ) -> torch.Tensor | None:
        """A receive buffer (W x ``nbytes``) whose own row the caller fills as its input.

        None where the all-gather takes its input apart (see ``all_gather``'s ``into``).
        """

    def all_gather(
        self,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        custom: CustomComm | None = None,
        into: torch.Tensor | None = None,
    ) -> GatheredRows:
        """Gather ``input`` (N uint8 bytes) from every rank; the handle yields the W rows.

        ``custom``: a user all-gather to run instead of the runtime's own. ``into``: the
        buffer ``gather_buffer`` gave, whose row of this rank ``input`` is (in place).
        """

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        custom: CustomComm | None = None,
        op: Reduction = SUM,
    ) -> CollectiveHandle:
        """Reduce row r of ``input`` (W, S) over ranks by ``op`` into ``output`` (S) on rank r.

        ``custom``: a user reduce-scatter to run instead of the runtime's own.
        """

    def exchange_rows(
        self, rows: torch.Tensor, group: dist.ProcessGroup, *, label: str = "", algorithm: str
    ) -> GatheredRows:
        """Send row j of ``rows`` (W, B uint8) to rank j; the handle yields each rank's for us.

        A compressed reduce-scatter's transport; ``algorithm`` names its format.
        """

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        op: Reduction = SUM,
    ) -> CollectiveHandle:
        """Reduce ``tensor`` over the ranks of ``group`` by ``op``, in place."""
