"""Units as groups: the modules of each ``fully_shard`` call of a plan, found and checked.

``PlanOptions.units`` names the calls by module FQN; this module resolves the names on the
model, refuses what the engine would refuse (or what would leave parameters unsharded), names
each group as the engine does (its modules' FQNs joined by ", ", ``<root>`` for the root) and
resolves each unit's ``reshard_after_forward`` as the engine's ``fully_shard`` does.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from torch import nn

from shardkit.tools.plan.sharding_plan import ROOT, Unit

__all__ = ["UnitSelection", "select_units"]


@dataclass(frozen=True, slots=True)
class UnitSelection:
    """One unit, resolved on the model."""

    name: str
    """The engine's name of the group: its modules' FQNs joined by ", " (``<root>``)."""
    modules: tuple[nn.Module, ...]
    """The modules ``fully_shard`` is given, in the unit's order."""
    reshard_after_forward: bool | int
    """The unit's policy as the engine resolves it against the shard count (an int n: keep a
    1/n slice, 1 < n < the shard count). Always given, so
    the root unit keeps no default: it frees its parameters after forward when True."""


def select_units(model: nn.Module, units: tuple[Unit, ...], shard_size: int) -> list[UnitSelection]:
    """The units of ``units`` on ``model``, in call order (root last).

    Raises:
        ValueError: no root unit; an FQN no module has (near names listed); a container
            without forward; a unit listed after one of its ancestors' units (``fully_shard``
            is applied inner modules first); an int ``reshard_after_forward`` that does not
            divide the shard count.
    """
    if units[-1].modules != (ROOT,):
        raise ValueError(
            "shardkit.tools.plan: PlanOptions.units has no root unit (Unit(modules=(ROOT,)), "
            "last). Without it the first unit to run forward becomes the root of its own tree "
            "only: the other units would each try to be a root, and parameters outside every "
            "unit would be neither sharded nor have their gradients reduced"
        )
    named = dict(model.named_modules())
    selections: list[UnitSelection] = []
    for unit in units:
        modules = tuple(_module(named, fqn, unit) for fqn in unit.modules)
        name = ", ".join(fqn or "<root>" for fqn in unit.modules)
        policy = _policy(unit, name, shard_size)
        selections.append(UnitSelection(name, modules, policy))
    _check_order(units)
    return selections


def _module(named: dict[str, nn.Module], fqn: str, unit: Unit) -> nn.Module:
    module = named.get(fqn)
    if module is None:
        near = difflib.get_close_matches(fqn, [n for n in named if n], n=5, cutoff=0.5)
        hint = f"; near names: {', '.join(near)}" if near else ""
        raise ValueError(
            f"shardkit.tools.plan: unit {unit.name} names module {fqn!r}, which the model "
            f"does not have{hint}"
        )
    if isinstance(module, nn.ModuleList | nn.ModuleDict):
        raise ValueError(
            f"shardkit.tools.plan: unit {unit.name}: {fqn} is a {type(module).__name__} (a "
            "container with no forward), which fully_shard refuses; name the modules inside it"
        )
    return module


def _check_order(units: tuple[Unit, ...]) -> None:
    """Inner modules first: a module's call must come before any ancestor's."""
    for i, unit in enumerate(units):
        for later in units[i + 1 :]:
            for outer in unit.modules:
                if outer == ROOT:
                    continue
                inner = [m for m in later.modules if m.startswith(f"{outer}.")]
                if inner:
                    raise ValueError(
                        f"shardkit.tools.plan: unit {unit.name} comes before unit {later.name}, "
                        f"whose {inner[0]} is inside {outer}: fully_shard takes inner modules "
                        "first, so list the inner unit first"
                    )


def _policy(unit: Unit, name: str, shard_size: int) -> bool | int:
    """``reshard_after_forward`` as ``fully_shard`` resolves it on a shard axis of this size."""
    value = unit.reshard_after_forward
    if isinstance(value, bool):
        return value
    if shard_size % value:
        raise ValueError(
            f"shardkit.tools.plan: unit {name}: reshard_after_forward={value} must divide the "
            f"shard count {shard_size} (an int n keeps a 1/n slice of the parameters)"
        )
    if value == 1:
        return False  # the engine: a 1/1 slice is the full parameters
    if value == shard_size:
        return True  # the engine: a 1/W slice is the shard itself
    return value  # a 1/n slice kept after forward, gathered within n ranks in backward
