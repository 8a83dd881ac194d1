"""State machines of a parameter group, with their allowed transitions.

A transition that is not in the table is a bug in the engine (or a hook run out of order), and
the error names the module it happened in.
"""

from __future__ import annotations

from enum import Enum, auto

__all__ = [
    "SHARDED_TRANSITIONS",
    "ShardedState",
    "TrainingState",
    "check_transition",
]


class ShardedState(Enum):
    """Which parameters are registered on the modules of a group."""

    SHARDED = auto()
    """The sharded DTensors are registered; no unsharded storage is held."""
    SHARDED_POST_FORWARD = auto()
    """Resharded to a smaller world after forward (``reshard_after_forward=int``)."""
    UNSHARDED = auto()
    """The full parameters are registered and their storage is allocated."""


class TrainingState(Enum):
    """What the group is doing now, as seen by its hooks."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


SHARDED_TRANSITIONS: dict[ShardedState, frozenset[ShardedState]] = {
    ShardedState.SHARDED: frozenset({ShardedState.UNSHARDED}),
    ShardedState.SHARDED_POST_FORWARD: frozenset({ShardedState.UNSHARDED, ShardedState.SHARDED}),
    ShardedState.UNSHARDED: frozenset({ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD}),
}


def check_transition(
    table: dict[ShardedState, frozenset[ShardedState]],
    old: ShardedState,
    new: ShardedState,
    where: str,
) -> None:
    """Raise if ``old -> new`` is not an allowed sharded-state transition."""
    if new not in table[old]:
        raise RuntimeError(f"FSDP state error in {where}: {old.name} -> {new.name} is not allowed")
