"""A sharding plan: the choices a training script makes around ``fully_shard``, as data.

Where ``fully_shard`` is called is FSDP2's bucketing: each call makes one unit (one group of
parameters gathered and reduced together). Around the calls a script chooses, per unit, when
full parameters are freed (``reshard_after_forward``), how far ahead units are gathered
(``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``), which modules
recompute their activations in backward (``checkpoint_wrapper``), whether shards live in host
memory (``CPUOffloadPolicy``), mixed precision, how gradients travel
(``set_reduce_precision``) and which modules some ranks skip (``set_conditional``).
:class:`ShardingPlan` holds those choices by module name, so the planner can predict them
(``PlanOptions``), the search can compare them, ``apply_plan`` can carry them out on a model
and ``shardkit-plan`` can write them as JSON.

This module holds the record and its own consistency checks only: it knows no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from shardkit.core import ReducePrecision

__all__ = [
    "ROOT",
    "CheckpointMode",
    "ShardingPlan",
    "Unit",
    "check_conditional",
    "prefetch_lists",
]

ROOT = ""
"""The root module's name in a plan (its FQN in ``named_modules()``)."""

CheckpointMode = Literal["full", "selective"]
"""How a module recomputes: ``full`` saves only its inputs and reruns its forward in backward
(``checkpoint_wrapper``); ``selective`` saves the outputs of matrix multiplies and attention
and recomputes the rest (torch's ``create_selective_checkpoint_contexts``)."""

_MODES = ("full", "selective")


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One ``fully_shard`` call: one module, or several modules sharing one group."""

    modules: tuple[str, ...]
    """FQNs (as the model names them before any wrapper), ``ROOT`` for the root. More than one
    is ``fully_shard([...])`` on the list: their parameters are gathered and reduced as one."""
    reshard_after_forward: bool | int = True
    """Free the full parameters after forward (True), keep them for backward (False), or keep
    a 1/n slice (an int n that divides the shard count)."""

    def __post_init__(self) -> None:
        modules = self.modules
        if (
            not isinstance(modules, tuple)
            or not modules
            or not all(isinstance(m, str) for m in modules)
        ):
            raise TypeError(f"Unit.modules must be a non-empty tuple of FQNs, got {modules!r}")
        if len(set(modules)) != len(modules):
            raise ValueError(f"Unit.modules names a module twice: {modules!r}")
        if ROOT in modules and len(modules) > 1:
            raise ValueError("Unit.modules: the root is a unit of its own")
        value = self.reshard_after_forward
        if not isinstance(value, bool | int):
            raise TypeError(f"Unit.reshard_after_forward must be a bool or int, got {value!r}")
        if not isinstance(value, bool) and value < 1:
            raise ValueError(f"Unit.reshard_after_forward must be a positive int, got {value}")

    @property
    def name(self) -> str:
        """How reports name the unit: its module, or its modules joined by '+'."""
        return "+".join(m or "<root>" for m in self.modules)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingPlan:
    """Every choice around ``fully_shard`` for one model; see the module docstring."""

    units: tuple[Unit, ...]
    """In the order ``fully_shard`` is called: inner modules first, the root (if a unit) last.
    The forward order of the non-root units is the order prefetching follows."""
    prefetch: int = 1
    """Units gathered ahead in forward and backward. 1 is the engine's own prefetch (the next
    unit); k > 1 sets each unit's forward and backward prefetch lists to the next k units."""
    checkpoint: tuple[tuple[str, CheckpointMode], ...] = ()
    """(FQN, mode) of the modules that recompute their activations in backward, wrapped before
    ``fully_shard`` is called."""
    offload: bool = False
    """``CPUOffloadPolicy()`` on every unit: sharded parameters, gradients and optimizer state
    in host memory, the optimizer step on the CPU."""
    param_dtype: torch.dtype | None = None
    """``MixedPrecisionPolicy.param_dtype`` of every unit."""
    reduce_dtype: torch.dtype | None = None
    """``MixedPrecisionPolicy.reduce_dtype`` of every unit."""
    reduce_precision: ReducePrecision | None = None
    """``set_reduce_precision`` on every unit (shardkit's engine only)."""
    conditional: tuple[str, ...] = ()
    """FQNs of the modules some ranks skip or run in another order (a vision tower, an early
    exit): each names a module of a unit, not the root, and that unit is marked with
    ``set_conditional(True, recurse=False)`` (shardkit's engine only); list nested units too.
    Its collectives are then issued by its anchor, the nearest unit around it not marked."""

    def __post_init__(self) -> None:
        if not isinstance(self.units, tuple) or not self.units:
            raise TypeError("ShardingPlan.units must be a non-empty tuple of Unit")
        seen: dict[str, str] = {}
        for unit in self.units:
            if not isinstance(unit, Unit):
                raise TypeError(f"ShardingPlan.units holds {unit!r}, not a Unit")
            for module in unit.modules:
                if module in seen:
                    raise ValueError(
                        f"ShardingPlan: module {module or '<root>'!r} is in two units "
                        f"({seen[module]} and {unit.name})"
                    )
                seen[module] = unit.name
        if ROOT in seen and self.units[-1].modules != (ROOT,):
            raise ValueError("ShardingPlan: the root unit must come last (fully_shard order)")
        prefetch = self.prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"ShardingPlan.prefetch must be a positive int, got {prefetch!r}")
        names: set[str] = set()
        for entry in self.checkpoint:
            if (
                not isinstance(entry, tuple)
                or len(entry) != 2
                or not isinstance(entry[0], str)
                or entry[1] not in _MODES
            ):
                raise ValueError(
                    f"ShardingPlan.checkpoint entries are (FQN, 'full' | 'selective'): {entry!r}"
                )
            if entry[0] == ROOT:
                raise ValueError("ShardingPlan.checkpoint: the root cannot be checkpointed")
            if entry[0] in names:
                raise ValueError(f"ShardingPlan.checkpoint names {entry[0]!r} twice")
            names.add(entry[0])
        check_conditional(self.conditional, "ShardingPlan.conditional")
        for fqn in self.conditional:
            if fqn not in seen:
                raise ValueError(
                    f"ShardingPlan.conditional: module {fqn!r} is in no unit; only a unit "
                    "(a fully_shard call) can be marked conditional"
                )
        if not isinstance(self.offload, bool):
            raise TypeError(f"ShardingPlan.offload must be a bool, got {self.offload!r}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, torch.dtype) or not value.is_floating_point
            ):
                raise ValueError(f"ShardingPlan.{name} must be a floating dtype or None: {value!r}")
        if self.reduce_precision is not None and not isinstance(
            self.reduce_precision, ReducePrecision
        ):
            raise TypeError("ShardingPlan.reduce_precision must be a ReducePrecision or None")

    @property
    def module_names(self) -> tuple[str, ...]:
        """Every module a unit names, in unit order."""
        return tuple(m for unit in self.units for m in unit.modules)

    @property
    def checkpointed(self) -> dict[str, CheckpointMode]:
        """FQN -> recomputation mode."""
        return dict(self.checkpoint)

    def prefetch_lists(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None:
        """Per unit, the units (by index) its forward and backward prefetch lists name.

        None at ``prefetch == 1`` (the engine's own prefetch, no lists set); see
        :func:`prefetch_lists`.
        """
        return prefetch_lists(self.units, self.prefetch)


def check_conditional(conditional: object, where: str) -> None:
    """Refuse a list of conditional modules that is not a tuple of distinct non-root FQNs.

    Raises:
        TypeError: not a tuple of strings.
        ValueError: the root (every rank runs it, and its hooks issue the marked modules'
            collectives), or a name given twice.
    """
    if not isinstance(conditional, tuple) or not all(isinstance(m, str) for m in conditional):
        raise TypeError(f"{where} must be a tuple of module FQNs, got {conditional!r}")
    if ROOT in conditional:
        raise ValueError(f"{where}: the root cannot be conditional (every rank runs it)")
    if len(set(conditional)) != len(conditional):
        raise ValueError(f"{where} names a module twice: {conditional!r}")


def prefetch_lists(
    units: tuple[Unit, ...], prefetch: int
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None:
    """What ``set_modules_to_forward_prefetch`` / ``..._backward_prefetch`` get, per unit.

    Forward runs the root first, then the other units in plan order; backward runs the root
    first, then the others in reverse. Each unit's list is the next ``prefetch`` units in that
    direction (possibly empty: an empty list is still set, so no implicit prefetch is left).
    Returned as (forward targets, backward targets) unit indices, one pair per unit; None at
    ``prefetch == 1``, where no list is set.
    """
    if prefetch == 1:
        return None
    roots = [i for i, u in enumerate(units) if u.modules == (ROOT,)]
    others = [i for i, u in enumerate(units) if u.modules != (ROOT,)]
    forward, backward = [*roots, *others], [*roots, *reversed(others)]

    def after(order: list[int], unit: int) -> tuple[int, ...]:
        at = order.index(unit)
        return tuple(order[at + 1 : at + 1 + prefetch])

    return tuple((after(forward, i), after(backward, i)) for i in range(len(units)))
