"""One root's orders of a step, and the prefetch decisions drawn from them (``schedule``).

Forward prefetch follows the previous step's pre-forward order inside the root's forward;
backward prefetch the post-forward order of this step, reversed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["StepSchedule"]

G = TypeVar("G", bound=Hashable)


@dataclass(slots=True)
class StepSchedule(Generic[G]):
    """One root's orders of the step, and the prefetch decisions drawn from them."""

    forward_order: list[G] = field(default_factory=list)
    """Groups in pre-forward order this step."""
    previous_forward_order: list[G] = field(default_factory=list)
    """Last step's order inside the root's forward: what forward prefetch follows."""
    root_forward_calls: int | None = None
    """How many of ``forward_order`` ran inside the root's forward (None: not ended yet).
    Calls after it (a chunked loss calling the output head) are not prefetched: the root's
    post-forward would free the prefetched gather before they run, wasting it."""
    skipped: set[G] = field(default_factory=set)
    """Groups prefetched by order that a forward then did not run (a layer dropped, a branch
    not taken): freed unused at the root's post-forward, so they gather at their own
    pre-forward from then on, as torch's ``fully_shard`` always does."""
    post_forward_order: list[G] = field(default_factory=list)
    """Groups in post-forward order: backward runs it in reverse."""
    backward_reaches: set[G] = field(default_factory=set)
    """Groups whose forward outputs need gradients: the only ones backward gathers."""

    def begin_forward(self) -> None:
        """The root's pre-forward: this step's order becomes the previous one."""
        if self.forward_order:
            inside = self.root_forward_calls
            self.previous_forward_order = self.forward_order[:inside]
            self.forward_order = []
        self.root_forward_calls = None

    def finished_root_forward(self, gathered: Iterable[G]) -> None:
        """The root's post-forward: the calls so far are the ones forward prefetch follows.

        ``gathered``: the groups it found gathered and not in their forward; one the root's
        forward did not run was prefetched for nothing, and is not prefetched again.
        """
        self.root_forward_calls = len(self.forward_order)
        ran = set(self.forward_order)
        self.skipped.update(group for group in gathered if group not in ran)

    def ran_forward(self, group: G, explicit: Sequence[G] | None) -> Sequence[G]:
        """A group's pre-forward gathered it: the groups to prefetch now.

        ``explicit``: the modules set with ``set_modules_to_forward_prefetch``, or None.
        """
        self.forward_order.append(group)
        if explicit is not None:
            return explicit
        previous, position = self.previous_forward_order, len(self.forward_order)
        if position >= len(previous):
            return []
        following = previous[position]
        return [following] if following != group and following not in self.skipped else []

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
        self.root_forward_calls = None
        self.end_backward()
