"""RootContext: what every state under one root shares; RootState: a state, as seen from below.

A root's lazy init (``FSDPState.lazy_init``) collects every state in its module tree into
one :class:`RootContext`, on a communication context (:func:`comm_context_for`), and names
each group's parameters as the root sees them (:func:`name_from_root`). Moved out of
``fsdp_state`` so that module holds the hooks; the init's sequence stays there.

:class:`RootState` is what the engine's helpers read and set on a state (``FSDPState``), the
root or one under it: the table of states (``state_registry``), Join and its dry step, the
step's trace, the usage checks, manual finalization. ``fsdp_state`` imports them; through
the protocol they name no class of the module above them, so the engine's imports run one
way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from shardkit.core.engine.backward import BackwardTracker
from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.collectives import ProcessGroupRuntime
from shardkit.core.runtime.protocol import CollectiveRuntime
from shardkit.core.runtime.watch.step_check import Verdict
from shardkit.core.schedule import StepDriver

__all__ = [
    "RootContext",
    "RootState",
    "comm_context_for",
    "name_from_root",
    "new_comm_context",
]


class RootState(Protocol):
    """One ``fully_shard`` call's state (``FSDPState``), as the engine's helpers use it."""

    is_root: bool | None
    """Whether it is its tree's root; None until a root's lazy init took it in."""
    ctx: RootContext | None
    """Its root's context, from the root's lazy init on."""
    fqn: str
    """Its modules' names as the root sees them (``"<root>"`` for the root module)."""
    manual_finalization: bool
    """``set_manual_backward_finalization``'s setting, read when a backward starts."""
    shared_comm: CommContext | None
    """Set by ``share_comm_ctx`` before the first forward: the context its lazy init takes."""

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The call's module(s)."""

    @property
    def groups(self) -> tuple[FSDPParamGroup, ...]:
        """Its own parameter groups, one per mesh."""

    @property
    def device(self) -> torch.device:
        """Where its parameters are gathered and computed."""

    @property
    def all_groups(self) -> list[FSDPParamGroup]:
        """Every group under its root (after the root's lazy init)."""

    def lazy_init(
        self, runtime: CollectiveRuntime | None = None, *, provisional: bool = False
    ) -> None:
        """Make it the root of its tree, unless a root already took it in."""

    def end_backward(self, *, last: bool) -> None:
        """The driver's end of backward for every group (``last``: finish every reduction)."""

    def check_step_end(self) -> None:
        """The step check where a step ends (``collectives_agree``)."""

    def reset_iter_state(self) -> None:
        """Recover after an exception mid-step (on the root)."""


@dataclass(slots=True)
class RootContext:
    """Iteration state of one root: every state, and the order groups ran in."""

    states: list[RootState]
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
    forward_with_grad: bool = False
    """The root's latest forward ran with gradients on: a call inside it with them off may be a
    reentrant checkpoint's, which backward runs again (``backward._InputGradsWatch``)."""
    """The root's forward is running: outside it (a chunked loss calling a head), a local
    tree's groups run their own hooks (rule 5 of [Note: post-backward trigger])."""
    thread: int | None = None
    """The thread that ran the latest forward: state dicts from any other are taken off
    the modules (see [Note: off-thread state dicts])."""
    verdict: Verdict | None = None
    """The last step check's verdict, on an accelerator, settled at the root's next forward
    (``collectives_agree``)."""
    provisional: bool = False
    """Made by ``unshard()`` before any forward, which torch's does without making a root:
    a root that contains these states later takes them over (see ``lazy_init``)."""


def comm_context_for(runtime: CollectiveRuntime | None, shared: CommContext | None) -> CommContext:
    """A root's context: on ``runtime`` if one is given, else the shared one, else a new one."""
    if runtime is not None:
        return CommContext(runtime=runtime, pool=runtime.pool)
    if shared is not None:
        return shared
    return new_comm_context()


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
