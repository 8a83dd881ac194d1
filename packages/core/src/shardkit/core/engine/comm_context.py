"""The communication state shared by every parameter group under one root.

Built at the root's lazy init and passed down to the groups. It knows the runtime, the pool
and the reductions in flight, but nothing of groups or states (so nothing here imports them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from shardkit.core.runtime.device import HostCopies
from shardkit.core.runtime.pool import BufferPool
from shardkit.core.runtime.protocol import CollectiveRuntime

__all__ = ["CommContext", "InFlightReduction"]


class InFlightReduction(Protocol):
    """A gradient reduction issued and not yet finished."""

    def finish(self, comm: CommContext) -> None:
        """Wait for it, then assign the reduced gradients."""


@dataclass(slots=True)
class CommContext:
    """The collective runtime and the buffers that groups share."""

    runtime: CollectiveRuntime
    pool: BufferPool = field(default_factory=BufferPool)
    pending_reduces: deque[InFlightReduction] = field(default_factory=deque)
    host_copies: HostCopies = field(default_factory=HostCopies)
    """Copies to and from pinned host memory (CPU offload) that the host waits for at the end
    of backward. See [Note: gpu schedule] (CPU offload)."""

    def finish_oldest(self) -> None:
        """Finish the oldest reduction in flight.

        Nothing may refer to the finished reduction once this returns: a variable holding it
        would keep its send buffer (and, on gloo, its received rows) alive while the next
        reduction allocates its own.
        """
        self.pending_reduces.popleft().finish(self)

    def finish_all(self) -> None:
        """Finish every reduction in flight."""
        while self.pending_reduces:
            self.finish_oldest()
