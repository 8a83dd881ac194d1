"""Collectives the lifetime checks record as in flight, as one pool task sees them.

The records are process-wide and a worker runs many tasks: a collective abandoned by an
earlier task's error stays recorded while its handle lives (a traceback's frames may hold it
until the cycle collector runs). A task counts only the collectives it issued itself.
"""

from __future__ import annotations

import gc

from shardkit.core.runtime.watch.lifetimes import Flight, in_flight

__all__ = ["baseline", "since"]


def baseline() -> frozenset[Flight]:
    """What is recorded before the task issues anything (after collecting dead cycles)."""
    gc.collect()
    return frozenset(in_flight())


def since(before: frozenset[Flight]) -> list[Flight]:
    """The collectives recorded now that were not at ``before``, oldest first."""
    return [flight for flight in in_flight() if flight not in before]
