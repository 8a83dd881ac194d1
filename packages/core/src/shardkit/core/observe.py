"""A small event bus: the engine reports collectives and state transitions to subscribers.

Profiling tools subscribe here instead of patching the engine. With no subscriber, emitting
costs one truth test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CollectiveEvent",
    "CollectiveIssuedEvent",
    "Event",
    "StateTransitionEvent",
    "emit",
    "has_subscribers",
    "subscribe",
]


@dataclass(frozen=True, slots=True)
class CollectiveEvent:
    """One collective issued by the runtime."""

    kind: str
    """'all_gather', 'reduce_scatter' or 'all_reduce'."""
    group_size: int
    """Ranks in the process group."""
    input_bytes: int
    """Bytes this rank contributes."""
    sent_bytes: int
    """Bytes this rank must send for a bandwidth-optimal algorithm."""
    algorithm: str
    """How it was carried out, e.g. 'all_to_all+sum' for gloo's reduce-scatter."""
    module_fqn: str = ""
    """The module whose parameters it gathers or whose gradients it reduces ('<root>' for
    the root, '' when not given)."""


@dataclass(frozen=True, slots=True)
class CollectiveIssuedEvent:
    """The runtime finished issuing the collective announced by the last CollectiveEvent.

    Between the two, on the same thread, come the c10d calls that carry it out (on gloo, one
    send and one receive per peer), so a tracker can tell them from the program's own.
    """

    kind: str


@dataclass(frozen=True, slots=True)
class StateTransitionEvent:
    """A parameter group moved between phases or sharded states."""

    module_fqn: str
    what: str
    """'unshard', 'reshard', 'pre_forward', 'post_forward', 'pre_backward' or 'post_backward'."""


Event = CollectiveEvent | CollectiveIssuedEvent | StateTransitionEvent
_subscribers: list[Callable[[Event], None]] = []


def subscribe(callback: Callable[[Event], None]) -> Callable[[], None]:
    """Deliver every future event to ``callback``; returns a function that unsubscribes."""
    _subscribers.append(callback)

    def unsubscribe() -> None:
        if callback in _subscribers:
            _subscribers.remove(callback)

    return unsubscribe


def has_subscribers() -> bool:
    """Whether anyone listens (callers skip building events otherwise)."""
    return bool(_subscribers)


def emit(event: Event) -> None:
    """Deliver ``event`` to every subscriber."""
    for callback in tuple(_subscribers):
        callback(event)
