"""One communication context for several roots: ``share_comm_ctx``.

Pipeline parallelism makes each model chunk an FSDP root of its own. Sharing one context lets
the chunks reuse one buffer pool and one queue of reductions in flight (and, on CUDA, one set
of streams), instead of each holding its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.root_context import RootState, new_comm_context
from shardkit.core.engine.state_registry import state_of

__all__ = ["share_comm_ctx"]


def share_comm_ctx(modules: Sequence[Any]) -> None:
    """Make every module in ``modules`` use the first one's communication context.

    Call it before or after the first forward, with the FSDP roots (e.g. the pipeline
    stages of this rank).

    Raises:
        ValueError: an element is not a module sharded with shardkit's ``fully_shard``.
    """
    from shardkit.core.fsdp_module import FSDPModule

    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {type(module).__name__}")
    if not modules:
        return
    states = [state_of(m) for m in modules]
    comm = _comm_of(states[0])
    for state in states[1:]:
        _use(state, comm)


def _comm_of(state: RootState) -> CommContext:
    if state.ctx is not None:
        return state.ctx.comm
    if state.shared_comm is None:
        state.shared_comm = new_comm_context()
    return state.shared_comm


def _use(state: RootState, comm: CommContext) -> None:
    if state.ctx is None:
        state.shared_comm = comm  # taken at the state's lazy init
        return
    state.ctx.comm.finish_all()  # nothing of the old context may be left in flight
    state.ctx.comm = comm
    for other in state.ctx.states:
        for group in other.groups:
            group.attach_comm(comm)
