"""Which modules are FSDP1 wrappers, and what each one is (its unit).

The wrapper's own data lives in one :class:`UnitState` per wrapper, kept here rather than in
loose attributes, so every part of the package (state dicts, optimizer state, gradients)
reads the same thing the same way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch import nn

from shardkit.legacy.configs import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    StateDictSettings,
    StateDictType,
)
from shardkit.legacy.construct import Unit
from shardkit.legacy.flat_params import FlatParam

__all__ = ["UnitState", "is_unit", "register_unit", "unit_of", "units_in"]


def _default_settings() -> StateDictSettings:
    return StateDictSettings(
        StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
    )


@dataclass(slots=True)
class UnitState:
    """One wrapper: its unit, its module, its state-dict settings, whether it is the root."""

    unit: Unit
    module: nn.Module
    """The wrapped module (``_fsdp_wrapped_module``)."""
    settings: StateDictSettings = field(default_factory=_default_settings)
    """What ``state_dict()`` gives (``set_state_dict_type``)."""
    is_root: bool | None = None
    """Decided at the first forward (or root-only call), as FSDP1 does."""
    flat: FlatParam | None = None
    """With ``use_orig_params=False``: its flat parameter (None: it shards no parameter)."""
    comm_hook: object | None = None
    """FSDP1's communication hook, once ``register_comm_hook`` set one (see comm_hooks)."""


_UNITS: weakref.WeakKeyDictionary[nn.Module, UnitState] = weakref.WeakKeyDictionary()


def register_unit(wrapper: nn.Module, state: UnitState) -> None:
    """Record that ``wrapper`` is an FSDP1 wrapper with ``state``."""
    _UNITS[wrapper] = state


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP1 wrapper of this package."""
    return module in _UNITS


def unit_of(wrapper: nn.Module) -> UnitState:
    """The state of ``wrapper``.

    Raises:
        TypeError: ``wrapper`` is not a ``shardkit.legacy.FullyShardedDataParallel``.
    """
    state = _UNITS.get(wrapper)
    if state is None:
        raise TypeError(
            f"{type(wrapper).__name__} is not a shardkit.legacy FullyShardedDataParallel"
        )
    return state


def units_in(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
    """The wrappers in ``module``'s tree (itself included), outermost first.

    Args:
        module: any module.
        root_only: only the wrappers that no other wrapper in the tree holds.
    """
    found: list[nn.Module] = []

    def visit(m: nn.Module, inside: bool, seen: set[int]) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        mine = m in _UNITS
        if mine and not (root_only and inside):
            found.append(m)
        for child in m.children():
            visit(child, inside or mine, seen)

    visit(module, False, set())
    return found
