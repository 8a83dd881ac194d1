"""Which ``FSDPState`` manages which module: the one table ``fully_shard`` writes.

The layout view, the state-dict code and the FSDPModule methods find a model's groups
through it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from shardkit.core.engine.fsdp_state import FSDPState

__all__ = ["is_managed", "register_state", "state_of", "states_under"]

# Weak keys: a sharded module that the user drops takes its state with it.
_STATES: weakref.WeakKeyDictionary[nn.Module, FSDPState] = weakref.WeakKeyDictionary()


def register_state(module: nn.Module, state: FSDPState) -> None:
    """Record that ``state`` manages ``module``."""
    _STATES[module] = state


def is_managed(module: nn.Module) -> bool:
    """Whether a ``fully_shard`` call manages ``module`` itself."""
    return module in _STATES


def state_of(module: nn.Module) -> FSDPState:
    """The state managing ``module``.

    Raises:
        RuntimeError: ``module`` is not managed by shardkit's ``fully_shard``.
    """
    state = _STATES.get(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} is not managed by shardkit's fully_shard")
    return state


def states_under(module: nn.Module) -> list[FSDPState]:
    """Every state whose modules lie in ``module``'s tree, outermost first, each once."""
    seen: dict[int, FSDPState] = {}
    for sub in module.modules():
        state = _STATES.get(sub)
        if state is not None:
            seen.setdefault(id(state), state)
    return list(seen.values())
