"""A state's hooks on its modules' state dicts and loads, registered once at ``fully_shard``.

Reading a state dict registers the groups' shards as the parameters (or, off the training
thread, copies them: ``offthread``). A load frees any full copy first, since it changes the
shards, and afterwards points the sharded storage at what was loaded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.offthread import after_state_dict, before_state_dict
from shardkit.core.engine.root_context import RootContext

__all__ = ["register_state_dict_hooks"]


class _HookedState(Protocol):
    """What the hooks read of the state whose modules they are on."""

    @property
    def ctx(self) -> RootContext | None: ...

    @property
    def groups(self) -> Sequence[FSDPParamGroup]: ...


def register_state_dict_hooks(state: _HookedState, modules: Sequence[nn.Module]) -> None:
    """Put the four hooks on each of ``modules``.

    Partials, not bound methods: torch marks the hooks it is given, which a method refuses.
    """
    for module in modules:
        module.register_state_dict_pre_hook(functools.partial(_before_state_dict, state))
        module.register_state_dict_post_hook(functools.partial(_after_state_dict, state))
        module.register_load_state_dict_pre_hook(functools.partial(_before_load, state))
        module.register_load_state_dict_post_hook(functools.partial(_after_load, state))


def _before_state_dict(
    state: _HookedState, module: nn.Module, prefix: str, keep_vars: bool
) -> None:
    before_state_dict(state, module, prefix)  # off the training thread: leaves the modules


def _after_state_dict(
    state: _HookedState,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    metadata: Any,
) -> None:
    after_state_dict(state, module, state_dict, prefix)  # off-thread: copies put in place


def _before_load(state: _HookedState, module: nn.Module, *args: Any) -> None:
    for group in state.groups:
        # Free the full parameters: the load changes the shards, so a full copy kept from an
        # earlier forward (root, or reshard_after_forward=False) would be stale.
        group.reshard()


def _after_load(state: _HookedState, module: nn.Module, incompatible_keys: Any) -> None:
    for group in state.groups:
        group.resync_sharded_storage()
