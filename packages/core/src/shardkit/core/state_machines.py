"""State machines of a parameter group, with their allowed transitions.

A transition that is not in the table is a bug in the engine (or a hook run out of order), and
the error names the module it happened in.

A leaf that imports nothing of shardkit: the engine moves through these states, and
``shardkit.core.schedule``, a seam published pure, names ``TrainingState`` without loading the
engine.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TypeVar

__all__ = [
    "SHARDED_TRANSITIONS",
    "TRAINING_TRANSITIONS",
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

    # Members are singletons: identity hashing is exact, and C-level (Enum's own hashes the
    # name in Python; the transition checks look states up several times per group per step).
    __hash__ = object.__hash__


class TrainingState(Enum):
    """What the group is doing now, as seen by its hooks."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()

    __hash__ = object.__hash__  # as ShardedState's


SHARDED_TRANSITIONS: dict[ShardedState, frozenset[ShardedState]] = {
    ShardedState.SHARDED: frozenset({ShardedState.UNSHARDED}),
    ShardedState.SHARDED_POST_FORWARD: frozenset({ShardedState.UNSHARDED, ShardedState.SHARDED}),
    ShardedState.UNSHARDED: frozenset({ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD}),
}


S = TypeVar("S", bound=Enum)

_IDLE, _FORWARD = TrainingState.IDLE, TrainingState.FORWARD
_PRE, _POST = TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD

# Staying in a state is always allowed (a hook that finds the work done). Backward may start
# from FORWARD: a root nested inside a group's forward finishes its own forward first. A
# group's reduction may start from any state: its last gradient decides, and the final
# callback reduces whatever backward left unreduced. A group backward ended may be gathered
# again in the same backward, when a reentrant checkpoint recomputes a call of it there
# (``StepDriver.regather``). Every path ends in IDLE.
TRAINING_TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = {
    _IDLE: frozenset({_IDLE, _FORWARD, _PRE, _POST}),
    _FORWARD: frozenset({_FORWARD, _IDLE, _PRE, _POST}),
    _PRE: frozenset({_PRE, _POST, _IDLE}),
    _POST: frozenset({_POST, _PRE, _IDLE}),
}


def check_transition(table: dict[S, frozenset[S]], old: S, new: S, where: str) -> None:
    """Raise if ``old -> new`` is not in ``table`` (a bug in the engine or a hook order).

    Raises:
        RuntimeError: naming the module ``where`` it happened.
    """
    if new not in table[old]:
        raise RuntimeError(
            f"FSDP state error in {where or '<root>'}: {type(old).__name__} "
            f"{old.name} -> {new.name} is not allowed"
        )
