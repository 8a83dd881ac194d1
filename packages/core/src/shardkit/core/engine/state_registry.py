"""Which ``FSDPState`` manages which module: the one table ``fully_shard`` writes.

The layout view, the state-dict code and the FSDPModule methods find a model's groups
through it. It holds the states as :class:`~shardkit.core.engine.root_context.RootState`
(what the engine's helpers use of them): ``fsdp_state`` imports this table.
"""

from __future__ import annotations

import weakref

from torch import nn

from shardkit.core.engine.root_context import RootState

__all__ = ["is_managed", "register_state", "state_of", "states_under"]

# Weak both ways, so that a sharded module the user drops takes its state (and its groups'
# buffers) with it. The module keeps its state alive through the hooks it registered (bound
# methods), and the state refers to its modules: a strong value here would refer to its own
# key, and no sharded module, nor its shards, would ever be freed in this process.
_STATES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[RootState]] = weakref.WeakKeyDictionary()


def register_state(module: nn.Module, state: RootState) -> None:
    """Record that ``state`` manages ``module`` (``module`` must hold ``state`` alive)."""
    _STATES[module] = weakref.ref(state)


def _lookup(module: nn.Module) -> RootState | None:
    ref = _STATES.get(module)
    return None if ref is None else ref()


def is_managed(module: nn.Module) -> bool:
    """Whether a ``fully_shard`` call manages ``module`` itself."""
    return _lookup(module) is not None


def state_of(module: nn.Module) -> RootState:
    """The state managing ``module``.

    Raises:
        RuntimeError: ``module`` is not managed by shardkit's ``fully_shard``.
    """
    state = _lookup(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} is not managed by shardkit's fully_shard")
    return state


def states_under(module: nn.Module) -> list[RootState]:
    """Every state whose modules lie in ``module``'s tree, outermost first, each once."""
    seen: dict[int, RootState] = {}
    for sub in module.modules():
        state = _lookup(sub)
        if state is not None:
            seen.setdefault(id(state), state)
    return list(seen.values())
