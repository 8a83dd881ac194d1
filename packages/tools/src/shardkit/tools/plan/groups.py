"""The planner's FSDP groups: which modules are sharded, and the layout of each.

The sizes come from shardkit.core's layout view (:func:`shardkit.core.layout.group_layout`),
the same arithmetic the engine builds its buffers from, fed with parameter shapes alone (no
process group, no allocation); so a plan's bytes equal what the engine reports. What the
planner adds is which modules become groups, and the few facts about a group's buffers that
the step needs beyond their sizes (the sharded gradients' dtype).

Which modules: those a wrap policy selects (by default every element of an ``nn.ModuleList``,
a decoder's blocks), or the units of a plan (``PlanOptions.units``, each a ``fully_shard``
call of one or several modules). Units are resolved on the model by FQN, refused where the
engine would refuse them (or where they would leave parameters unsharded), named as the engine
names its groups (the modules' FQNs joined by ", ", ``<root>`` for the root), and their
``reshard_after_forward`` resolved as ``fully_shard`` resolves it.

See docs/notes/001-flat-group-buffers.md.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from shardkit.core.layout import (
    GroupLayout,
    ParamLayout,
    ParamSpec,
    group_layout,
    keeps_own_dtype,
)
from shardkit.tools.plan.options import PlanOptions, WrapPolicy
from shardkit.tools.plan.sharding_plan import ROOT, Unit

__all__ = [
    "GroupSpec",
    "UnitSelection",
    "build_groups",
    "named_module",
    "select_group_modules",
    "select_units",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """One ``fully_shard`` call: its module and the core's layout of its parameters."""

    fqn: str
    """The module's FQN, '<root>' for the root (as the engine names groups)."""
    module: nn.Module
    """The sharded module."""
    layout: GroupLayout
    """Every size and offset of its buffers, as the engine computes them."""
    modules: tuple[nn.Module, ...] = ()
    """Every module of the ``fully_shard`` call when it was given several (a unit of
    ``PlanOptions.units``); empty for one (``module``)."""
    reshard_after_forward: bool | int | None = None
    """The unit's own policy (``PlanOptions.units``); None: ``PlanOptions``'s."""

    @property
    def call_modules(self) -> tuple[nn.Module, ...]:
        """The modules of the ``fully_shard`` call, ``module`` first."""
        return self.modules or (self.module,)

    @property
    def params(self) -> tuple[ParamLayout, ...]:
        """Its parameters, in the engine's order (module tree pre-order)."""
        return self.layout.params

    @property
    def world(self) -> int:
        """Shard count."""
        return self.layout.shard_world

    @property
    def trainable(self) -> tuple[ParamLayout, ...]:
        """Parameters that get gradients."""
        return self.layout.trainable

    @property
    def param_count(self) -> int:
        """Elements of all parameters, unsharded and unpadded."""
        return sum(p.numel for p in self.params)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The sharded gradients' dtype: the first trainable parameter's own."""
        trainable = self.trainable
        return trainable[0].dtype if trainable else torch.float32

    @property
    def sharded_grad_nbytes(self) -> int:
        """The sharded gradients: the reduce output, in the parameters' own dtype."""
        return self.layout.reduce_scatter_output_numel * self.grad_dtype.itemsize


def select_group_modules(model: nn.Module, wrap: WrapPolicy | None) -> list[tuple[str, nn.Module]]:
    """The (FQN, module) pairs that get a ``fully_shard`` call, root last.

    Raises:
        ValueError: a selected module has no forward of its own (a container), which
            ``fully_shard`` refuses.
    """
    chosen: list[tuple[str, nn.Module]] = []
    if wrap is None:
        chosen = _module_list_elements(model)
    else:
        for name, module in model.named_modules():
            if module is model:
                continue
            hit = wrap(name, module) if callable(wrap) else type(module).__name__ in wrap
            if hit:
                chosen.append((name, module))
    for name, module in chosen:
        if type(module).forward is nn.Module.forward:
            raise ValueError(
                f"shardkit.tools.plan: module {name} ({type(module).__name__}) has no forward "
                "(a container), which fully_shard refuses; select the modules inside it"
            )
    return [*chosen, ("", model)]


def _module_list_elements(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Elements of ``nn.ModuleList``s, outermost only (a block's own lists stay inside it)."""
    found: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        for child_name, child in reversed(list(module.named_children())):
            fqn = f"{name}.{child_name}" if name else child_name
            if isinstance(module, nn.ModuleList):
                found.append((fqn, child))  # an element: sharded whole, not entered
            else:
                stack.append((fqn, child))
    # The stack visits children in registration order; keep that order (forward order).
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(found, key=lambda item: order[id(item[1])])


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


def named_module(named: dict[str, nn.Module], fqn: str, named_by: str) -> nn.Module:
    """The module ``fqn`` of ``named`` (a model's ``named_modules()``).

    Raises:
        ValueError: the model has no such module; the message says what named it
            (``named_by``: "unit blocks.0", "checkpoint") and lists near names.
    """
    module = named.get(fqn)
    if module is None:
        near = difflib.get_close_matches(fqn, [n for n in named if n], n=5, cutoff=0.5)
        hint = f"; near names: {', '.join(near)}" if near else ""
        raise ValueError(
            f"shardkit.tools.plan: {named_by} names module {fqn!r}, which the model does not "
            f"have{hint}"
        )
    return module


def _module(named: dict[str, nn.Module], fqn: str, unit: Unit) -> nn.Module:
    module = named_module(named, fqn, f"unit {unit.name}")
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


def build_groups(
    model: nn.Module,
    options: PlanOptions,
    shard_size: int,
    replicas: int = 1,
    local_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> list[GroupSpec]:
    """One GroupSpec per selected module that manages parameters, root last.

    A module's group holds the parameters in its tree that no selected submodule holds, as
    when ``fully_shard`` is applied bottom-up. ``local_shapes`` gives the TP-local shape of
    the parameters tensor parallelism distributes: what the data-parallel axis shards.

    Raises:
        ValueError: a parameter is shared by two groups, or is 0-dim; the trainable
            parameters of a group have different gather dtypes and no ``reduce_dtype`` is
            set (the engine refuses all three).
    """
    calls = _calls(model, options, shard_size)
    is_group = {id(m) for _, modules, _ in calls for m in modules}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    owner: dict[int, str] = {}
    groups: list[GroupSpec] = []
    for fqn, modules, policy in calls:
        specs: list[ParamSpec] = []
        params = [p for m in modules for p in _own_params(m, is_group)]
        for param in dict.fromkeys(params):  # tied across the call's modules: once
            pname = names.get(id(param), "?")
            if id(param) in owner:
                raise ValueError(
                    f"shardkit.tools.plan: parameter {pname} is shared by the groups "
                    f"{owner[id(param)]} and {fqn}; fully_shard needs it in one group"
                )
            owner[id(param)] = fqn
            spec = _param_spec(pname, param, (local_shapes or {}).get(pname))
            keeps = keeps_own_dtype(options, param, pname)  # options: the policy's fields
            specs.append(replace(spec, keeps_own_dtype=keeps) if keeps else spec)
        if len(modules) > 1 and not all(spec.requires_grad for spec in specs):
            # The engine ends such a group's backward through its first call's inputs (a
            # partial call), not through a frozen group's watched inputs: not modelled.
            raise NotImplementedError(
                f"shardkit.tools.plan: unit {fqn} of several modules has frozen parameters, "
                "whose backward the planner does not model; make each module a unit"
            )
        if specs:
            slice_n = None if isinstance(policy, bool) or policy is None else policy
            layout = _layout(fqn, specs, options, (shard_size, replicas), slice_n)
            groups.append(
                GroupSpec(
                    fqn=fqn,
                    module=modules[0],
                    layout=layout,
                    modules=modules if len(modules) > 1 else (),
                    reshard_after_forward=policy,
                )
            )
        elif options.units is not None and modules != (model,):
            # A root with nothing of its own is usual (every module under it a unit): it
            # still runs the step's hooks, with no group to gather, as without units.
            raise ValueError(
                f"shardkit.tools.plan: unit {fqn} holds no parameters of its own (the units "
                "before it hold them all): it would gather nothing; drop it"
            )
    return groups


def _calls(
    model: nn.Module, options: PlanOptions, shard_size: int
) -> list[tuple[str, tuple[nn.Module, ...], bool | int | None]]:
    """(group name, modules, own policy) of each ``fully_shard`` call, root last."""
    if options.units is not None:
        return [
            (u.name, u.modules, u.reshard_after_forward)
            for u in select_units(model, options.units, shard_size)
        ]
    return [(name or "<root>", (m,), None) for name, m in select_group_modules(model, options.wrap)]


def _own_params(module: nn.Module, is_group: set[int]) -> list[nn.Parameter]:
    """Parameters under ``module`` not under another group module, each once, pre-order."""
    seen: set[int] = set()
    found: list[nn.Parameter] = []
    stack = [module]
    while stack:
        current = stack.pop()
        for param in current._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                found.append(param)
        stack.extend(c for c in reversed(list(current.children())) if id(c) not in is_group)
    return found


def _param_spec(name: str, param: nn.Parameter, local: tuple[int, ...] | None) -> ParamSpec:
    if param.dim() == 0:
        raise ValueError(
            f"shardkit.tools.plan: parameter {name} is 0-dim, which fully_shard cannot shard"
        )
    if not param.is_meta:
        raise ValueError(
            f"shardkit.tools.plan: parameter {name} is on {param.device}; build the model "
            "under torch.device('meta'), or pass its factory (called under meta), so that "
            "planning allocates nothing"
        )
    if hasattr(param, "fsdp_pre_all_gather") or hasattr(param, "fsdp_post_all_gather"):
        # What such a parameter sends and holds unsharded is whatever its hooks return, known
        # only once the engine calls them (the core's layout lists it in hooks_pending).
        raise ValueError(
            f"shardkit.tools.plan: parameter {name} ({type(param).__name__}) is gathered "
            "through its all-gather hooks (fsdp_pre_all_gather / fsdp_post_all_gather), which "
            "the planner does not model; plan the model with plain parameters of the same "
            "shapes for an estimate, or measure it with CommTracker and MemoryTracker"
        )
    shape = tuple(param.shape) if local is None else local
    return ParamSpec(fqn=name, shape=shape, dtype=param.dtype, requires_grad=param.requires_grad)


def _layout(
    fqn: str,
    specs: list[ParamSpec],
    options: PlanOptions,
    mesh: tuple[int, int],
    post_forward_world: int | None,
) -> GroupLayout:
    shard_size, replicas = mesh
    try:
        return group_layout(
            specs,
            shard_world=shard_size,
            replicate_world=replicas,
            param_dtype=options.param_dtype,
            reduce_dtype=options.reduce_dtype,
            post_forward_world=post_forward_world,
        )
    except ValueError as err:  # the engine's refusal, said of the group it concerns
        raise ValueError(f"shardkit.tools.plan: group {fqn}: {err}") from err
