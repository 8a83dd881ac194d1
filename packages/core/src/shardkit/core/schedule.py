"""The engine's schedule: when each group is gathered, prefetched, freed and reduced.

Pure decisions over group handles of any hashable type: the engine runs them on its
``FSDPParamGroup`` objects (``engine/fsdp_state.py``, ``engine/backward.py``), and the planner in
``shardkit.tools`` on group indices, with no model and no process group. So the planner
predicts the step that happens: one schedule, run by both, never two copies kept in step.

A step, as this module decides it:

- **Forward.** A group gathers at its pre-forward (or finds its prefetched gather). It then
  prefetches the group after it in the *previous* step's forward order (a first step has
  none: it prefetches nothing), or the modules set with ``set_modules_to_forward_prefetch``.
  At its post-forward it frees its full parameters, keeps them, or keeps a 1/n slice, as
  ``reshard_after_forward`` says (:func:`after_forward`); the root keeps its own where the
  user left the default, since backward needs them first (:func:`root_reshards_after_forward`).
  The root's post-forward applies the same to the groups gathered but never run.
- **Backward.** A group whose outputs needed gradients gathers at its pre-backward, then
  prefetches the group before it in post-forward order, if backward will reach that one and
  has not yet (:meth:`StepSchedule.backward_prefetch`), or the modules set with
  ``set_modules_to_backward_prefetch``. A group's backward ends by one of the rules of
  ``backward.py`` (:func:`count_ends_backward`, :func:`inputs_end_backward`,
  :func:`ends_at_callback`), which frees it and starts its reduction. At most
  ``max_reduces_in_flight`` reductions run at once: starting one first finishes the oldest
  beyond that (:func:`reductions_to_finish`). The end-of-backward callback ends the groups
  left, finishes every reduction, and frees every group (``reshard_after_backward``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from shardkit.core.state_machines import TrainingState

__all__ = [
    "AfterForward",
    "StepSchedule",
    "TrainingState",
    "after_forward",
    "count_ends_backward",
    "ends_at_callback",
    "inputs_end_backward",
    "reductions_to_finish",
    "root_reshards_after_forward",
]

G = TypeVar("G", bound=Hashable)


class AfterForward(Enum):
    """What a group does with its full parameters at its post-forward."""

    KEEP = "keep"
    """Keep them for backward (``reshard_after_forward=False``)."""
    FREE = "free"
    """Free them; backward gathers again (``True``)."""
    SLICE = "slice"
    """Keep this rank's 1/n of them; backward gathers within n ranks (an int n)."""


def after_forward(policy: bool | int) -> AfterForward:
    """What ``reshard_after_forward=policy`` does at a group's post-forward."""
    if policy is False:
        return AfterForward.KEEP
    if policy is True:
        return AfterForward.FREE
    return AfterForward.SLICE


def root_reshards_after_forward(policy: bool | int, *, is_default: bool) -> bool | int:
    """The root's policy: it keeps its parameters where the user left the default.

    Backward starts with the root's own parameters (its outputs are the last made), so
    freeing them after forward would only gather them again at once.
    """
    return False if is_default else policy


def count_ends_backward(state: TrainingState, *, inputs_pending: bool) -> bool:
    """Whether a group whose every trainable gradient is in ends its backward now.

    In PRE_BACKWARD as usual, or FORWARD / IDLE where its gradients came though its
    pre-backward hook never ran (its outputs reached the loss through tensors made outside
    its forward hooks); never while a forward call's inputs still wait for their gradients
    (frozen parameters may still be read).
    """
    ends = state in (TrainingState.PRE_BACKWARD, TrainingState.FORWARD, TrainingState.IDLE)
    return ends and not inputs_pending


def inputs_end_backward(state: TrainingState, *, count_complete: bool) -> bool:
    """Whether backward through a group's inputs ends its backward (it has frozen parameters).

    ``count_complete``: every trainable parameter's gradient is in (vacuously, with none).
    """
    return state is TrainingState.PRE_BACKWARD and count_complete


def ends_at_callback(state: TrainingState, *, holds_grads: bool) -> bool:
    """Whether the end-of-backward callback ends a group's backward.

    So it does for a group that backward reached but whose count never completed (a
    parameter got no gradient), and for one holding gradients nobody took.
    """
    return state is TrainingState.PRE_BACKWARD or holds_grads


def reductions_to_finish(in_flight: int, limit: int) -> int:
    """How many of the oldest reductions in flight to finish before starting another."""
    return max(0, in_flight - limit + 1)


@dataclass(slots=True)
class StepSchedule(Generic[G]):
    """One root's orders of the step, and the prefetch decisions drawn from them."""

    forward_order: list[G] = field(default_factory=list)
    """Groups in pre-forward order this step."""
    previous_forward_order: list[G] = field(default_factory=list)
    """Last step's order: what forward prefetch follows."""
    post_forward_order: list[G] = field(default_factory=list)
    """Groups in post-forward order: backward runs it in reverse."""
    backward_reaches: set[G] = field(default_factory=set)
    """Groups whose forward outputs need gradients: the only ones backward gathers."""

    def begin_forward(self) -> None:
        """The root's pre-forward: this step's order becomes the previous one."""
        if self.forward_order:
            self.previous_forward_order = self.forward_order
            self.forward_order = []

    def ran_forward(self, group: G, explicit: Sequence[G] | None) -> Sequence[G]:
        """A group's pre-forward gathered it: the groups to prefetch now.

        ``explicit``: the modules set with ``set_modules_to_forward_prefetch``, or None.
        """
        self.forward_order.append(group)
        if explicit is not None:
            return explicit
        previous, position = self.previous_forward_order, len(self.forward_order)
        if position < len(previous) and previous[position] != group:
            return [previous[position]]
        return []

    def finished_forward(self, group: G) -> None:
        """A group's post-forward: its place in the order backward runs in reverse."""
        self.post_forward_order.append(group)

    def output_needs_grad(self, group: G) -> None:
        """Backward will reach ``group`` (an output of one of its calls needs a gradient)."""
        self.backward_reaches.add(group)

    def backward_prefetch(
        self, group: G, explicit: Sequence[G] | None, started: Callable[[G], bool]
    ) -> Sequence[G]:
        """A group's pre-backward gathered it: the groups to prefetch now.

        The one before it in post-forward order, if backward will reach it (a group whose
        outputs needed no gradient never runs backward: gathered now, it would be held until
        the end-of-backward callback) and has not ``started`` its backward yet.
        """
        if explicit is not None:
            return [g for g in explicit if not started(g)]
        order = self.post_forward_order
        for index in range(len(order) - 1, 0, -1):
            if order[index] == group:
                previous = order[index - 1]
                needed = previous != group and previous in self.backward_reaches
                return [previous] if needed and not started(previous) else []
        return []

    def end_backward(self) -> None:
        """The end-of-backward callback: this step's backward orders are spent."""
        self.post_forward_order.clear()
        self.backward_reaches.clear()

    def reset(self) -> None:
        """Recovery after an exception mid-step: forget the step's orders."""
        self.forward_order.clear()
        self.end_backward()
