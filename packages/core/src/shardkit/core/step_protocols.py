"""The step's operations as its driver asks for them: :class:`StepOps`, :class:`GroupSettings`.

:class:`~shardkit.core.schedule.StepDriver` decides which operation comes at which hook;
whoever runs the step decides what each one does: the engine on its ``FSDPParamGroup``
objects (``engine/step_ops.py``), the planner in ``shardkit.tools`` on group indices and a
ledger of bytes. These two protocols, and the :class:`AfterForward` action that one operation
takes, are all the driver knows of either. Inside the core, the schedule and the engine import
them from here; the other packages reach them through the published seam,
``shardkit.core.schedule``. Like it, this module loads nothing of the engine or the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from enum import Enum
from typing import Protocol, TypeVar

from shardkit.core.state_machines import TrainingState

__all__ = ["AfterForward", "GroupSettings", "StepOps"]

G = TypeVar("G", bound=Hashable)
G_co = TypeVar("G_co", bound=Hashable, covariant=True)


class AfterForward(Enum):
    """What a group does with its full parameters at its post-forward."""

    KEEP = "keep"
    """Keep them for backward (``reshard_after_forward=False``)."""
    FREE = "free"
    """Free them; backward gathers again (``True``)."""
    SLICE = "slice"
    """Keep this rank's 1/n of them; backward gathers within n ranks (an int n)."""


class GroupSettings(Protocol[G_co]):
    """A group's switches that the step's sequence reads (the engine's ``GroupOptions``)."""

    @property
    def reshard_after_forward(self) -> bool | int:
        """The group's policy at its post-forward (the root's already adjusted)."""

    @property
    def reshard_after_backward(self) -> bool:
        """Whether backward's end frees its full parameters."""

    @property
    def unshard_in_backward(self) -> bool:
        """Whether its pre-backward gathers its parameters."""

    @property
    def reduce_grads(self) -> bool:
        """Whether its backward reduces gradients (False: kept without gradient sync)."""

    @property
    def max_reduces_in_flight(self) -> int:
        """Reductions left in flight before its own starts (:data:`MAX_REDUCES_IN_FLIGHT`)."""

    @property
    def forward_prefetch(self) -> Sequence[G_co] | None:
        """Groups set to be gathered after its pre-forward; None: the schedule decides."""

    @property
    def backward_prefetch(self) -> Sequence[G_co] | None:
        """Groups set to be gathered after its pre-backward; None: the schedule decides."""


class StepOps(Protocol[G]):
    """What the step's decisions do to a group: the engine on its groups, the planner on sizes.

    Each operation is a no-op where there is nothing to do (a gather of a gathered group, a
    free of a freed one), as the engine's group methods are.
    """

    def settings(self, group: G) -> GroupSettings[G]:
        """The group's switches as they are now."""

    def state(self, group: G) -> TrainingState:
        """What the group is doing, as its hooks see it."""

    def set_state(self, group: G, state: TrainingState) -> None:
        """Move the group to ``state`` (checked against the allowed transitions)."""

    def event(self, what: str, group: G) -> None:
        """Report a state transition (``shardkit.core.StateTransitionEvent``'s names)."""

    def name(self, group: G) -> str:
        """The group's modules' FQNs, as the engine's messages and events name it."""

    def profiled(self, label: str, group: G | None = None) -> AbstractContextManager[object]:
        """A profiler range named as torch's for ``label`` of ``group`` (None: the root's)."""

    def run_step(self, name: str, group: G, step: Callable[[], None], *args: object) -> None:
        """Do ``step``, the group's ``pre_backward`` or ``post_backward``, or what replaced it.

        A tool may replace either through torch's names (``engine.replaceable_hooks``); it is
        called with ``args``, torch's arguments for that method, and calls ``step`` back.
        """

    def unshard(self, group: G, *, prefetch: bool = False) -> None:
        """Issue the group's all-gather (``prefetch``: ahead of its own hook)."""

    def wait(self, group: G) -> None:
        """Finish its all-gather (issuing it first if need be): its full parameters are in."""

    def is_unsharded(self, group: G) -> bool:
        """Whether its full parameters are in, or on the way."""

    def reshard(self, group: G) -> None:
        """Free its full parameters (finishing a gather nobody waited for)."""

    def free_after_forward(self, group: G, action: AfterForward) -> None:
        """Free (FREE) or slice (SLICE) its full parameters at the end of its forward."""

    def keep_idle_buffers(self, keep: bool) -> None:
        """Let communication buffers wait for reuse (forward), or give them all back."""

    def holds_grads(self, group: G) -> bool:
        """Whether its full parameters hold gradients that no reduction has taken."""

    def cover_missing_grads(self, group: G) -> None:
        """Let a conditional group's coming reduction go ahead where this rank lacks gradients.

        Its anchor's end of backward reduces it on every rank, also where a parameter got no
        gradient or the module did not run: zeros stand for what is missing, so the reduction
        is issued here as on its peers (``conditional_schedule``).
        """

    def take_grads(self, group: G) -> object | None:
        """Take its gradients for a reduction; None when there is none to start."""

    def reductions_in_flight(self) -> int:
        """Reductions started and not yet finished, of every group under the root."""

    def finish_oldest_reduction(self) -> None:
        """Wait for the oldest reduction in flight and assign its gradients."""

    def start_reduction(self, group: G, grads: object, *, assign_now: bool) -> None:
        """Start reducing what :meth:`take_grads` took (``assign_now``: see the driver)."""

    def finish_reductions(self) -> None:
        """Finish every reduction in flight (and what the host waits for after them)."""
