"""State shared by every FSDP state under one root, built at the root's lazy init."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardkit.core.runtime.pool import BufferPool
from shardkit.core.runtime.protocol import CollectiveRuntime

if TYPE_CHECKING:
    from shardkit.core.grad_reduce import PendingReduce
    from shardkit.core.param_group import FSDPParamGroup
    from shardkit.core.state import FSDPState

__all__ = ["CommContext", "RootContext"]


@dataclass(slots=True)
class CommContext:
    """The collective runtime and the buffers that groups share."""

    runtime: CollectiveRuntime
    pool: BufferPool = field(default_factory=BufferPool)
    pending_reduces: deque[PendingReduce] = field(default_factory=deque)
    max_reduces_in_flight: int = 1
    """Gradient reductions left running while backward goes on; older ones are finished."""


@dataclass(slots=True)
class RootContext:
    """Iteration state of one root: every state, and the order groups ran in."""

    states: list[FSDPState]
    comm: CommContext
    forward_order: list[FSDPParamGroup] = field(default_factory=list)
    """Groups in pre-forward order this iteration."""
    previous_forward_order: list[FSDPParamGroup] = field(default_factory=list)
    """Last iteration's order: what implicit forward prefetch follows."""
    post_forward_order: list[FSDPParamGroup] = field(default_factory=list)
    """Groups in post-forward order: backward runs it in reverse (backward prefetch)."""
    final_callback_queued: bool = False
