"""The boundary between parameter groups and the collective runtime.

Parameter groups call only this protocol; the runtime knows nothing about modules.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from shardkit.core.runtime.pool import BufferPool

__all__ = ["CollectiveHandle", "CollectiveRuntime", "GatheredRows"]


class CollectiveHandle(Protocol):
    """An issued collective. ``wait()`` blocks until its output may be read."""

    def wait(self) -> None:
        """Block until the collective's output is ready (idempotent)."""


class GatheredRows(Protocol):
    """An all-gather in flight."""

    def wait(self) -> list[torch.Tensor]:
        """Block until done; returns the W rows (N bytes each) in rank order."""

    def release(self) -> None:
        """Return the buffers behind the rows once they were copied out."""


class CollectiveRuntime(Protocol):
    """Issues collectives on flat buffers and returns handles."""

    pool: BufferPool
    """The buffers the runtime and the groups share (receive and send buffers)."""

    # ``label``: the module the collective serves, passed on to observers (CollectiveEvent).

    def all_gather(
        self, input: torch.Tensor, group: dist.ProcessGroup, *, label: str = ""
    ) -> GatheredRows:
        """Gather ``input`` (N uint8 bytes) from every rank; the handle yields the W rows."""

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
    ) -> CollectiveHandle:
        """Sum row r of ``input`` (W, S) over ranks into ``output`` (S) on rank r."""

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, label: str = ""
    ) -> CollectiveHandle:
        """Sum ``tensor`` over the ranks of ``group`` in place."""
