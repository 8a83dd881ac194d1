"""RootContext: what every state under one root shares, and the names the root gives them.

A root's lazy init (``FSDPState.lazy_init``) collects every state in its module tree into
one :class:`RootContext`, on a communication context (:func:`new_comm_context` by default),
and names each group's parameters as the root sees them (:func:`name_from_root`). Moved out
of ``fsdp_state`` so that module holds the hooks; the init's sequence stays there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardkit.core.engine.backward import BackwardTracker
from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.collectives import ProcessGroupRuntime
from shardkit.core.runtime.step_check import Verdict
from shardkit.core.schedule import StepDriver

if TYPE_CHECKING:
    # fsdp_state builds the context, so it imports this module.
    from shardkit.core.engine.fsdp_state import FSDPState

__all__ = [
    "RootContext",
    "name_from_root",
    "new_comm_context",
]


@dataclass(slots=True)
class RootContext:
    """Iteration state of one root: every state, and the order groups ran in."""

    states: list[FSDPState]
    comm: CommContext
    driver: StepDriver[FSDPParamGroup]
    """The step's sequence (``schedule``): every hook's operations, in their order."""
    backward: BackwardTracker
    """What autograd tells of each group's backward (see ``backward``)."""
    final_callback_queued: bool = False
    manual_finalization: bool | None = None
    """The root's ``set_manual_backward_finalization`` as this iteration's first backward
    found it (None: no backward since the last finalization); see [Note: torch-facing view]."""
    reduction_pending: bool = False
    """``finalize_backward(async_op=True)`` started reductions its handle has not finished."""
    local: bool = False
    """This forward took the local path: only the root's hooks work, until backward's end
    (see [Note: post-backward trigger], rule 4)."""
    in_root_forward: bool = False
    """The root's forward is running: outside it (a chunked loss calling a head), a local
    tree's groups run their own hooks (rule 5 of [Note: post-backward trigger])."""
    thread: int | None = None
    """The thread that ran the latest forward: state dicts from any other are taken off
    the modules (see [Note: off-thread state dicts])."""
    verdict: Verdict | None = None
    """The last step check's verdict, on an accelerator, settled at the root's next forward
    (``step_end``)."""
    provisional: bool = False
    """Made by ``unshard()`` before any forward, which torch's does without making a root:
    a root that contains these states later takes them over (see ``lazy_init``)."""


def new_comm_context() -> CommContext:
    """A communication context on c10d process groups (the default runtime)."""
    runtime = ProcessGroupRuntime()
    return CommContext(runtime=runtime, pool=runtime.pool)


def name_from_root(p: FSDPParam, param_names: dict[int, str], names: dict[int, str]) -> str:
    """``p``'s name from the root: as listed, or where it is held (``param_listing``)."""
    listed = param_names.get(id(p.sharded_param))
    if listed is not None:
        return listed
    slot = p.slots[0]
    module_name = names.get(id(slot.module))
    if module_name is None:
        return p.fqn
    return f"{module_name}.{slot.name}" if module_name else slot.name
