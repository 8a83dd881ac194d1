"""Optimizer steps on the local tensors of sharded parameters.

See [Note: local optimizer step]. Every operator on a DTensor goes through DTensor's
dispatcher (about 15 us of CPU each on this machine), and an elementwise optimizer runs
several per parameter: on a model of many small parameters that is most of a step. For the
optimizers whose update is elementwise, the DTensor result is the local result, so a global
pre-step hook hands the optimizer each parameter's local tensor (with its gradient and state
local too), and the post-step hook puts the DTensors back. Outside ``step()`` the optimizer
and its state dict see DTensors, exactly as before.

What the optimizer sees during a step (its param lists and a state table keyed by the local
tensors) is built once and kept in a plan that later steps reuse after cheap identity checks:
rebuilding it every step cost more than the DTensor wrapping of the gradients.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardkit.core.runtime.dtensors import dtensor_like, local_of, same_spec

__all__ = ["ELEMENTWISE_OPTIMIZERS", "allow_local_step", "restore", "restore_all"]

# Their update of a parameter reads that parameter, its gradient and its state, element by
# element (no norm, no reduction across elements): on DTensors of one placement, each rank's
# result is what it computes on its local tensors. Exact types only: a subclass may override
# step with anything.
ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adadelta,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.ASGD,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
    }
)


class _Owner(Protocol):
    """What holds a sharded parameter (an FSDPParam)."""

    @property
    def sharded_param(self) -> torch.Tensor: ...


# The holders of the sharded parameters whose local tensor the engine owns (a view of a
# group's buffer), by the parameter's id. Weak references to the holders, not the parameters:
# torch.utils.swap_tensors (module._apply) refuses a tensor that has a weak reference.
_ALLOWED: weakref.WeakValueDictionary[int, _Owner] = weakref.WeakValueDictionary()
_PLANS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan] = weakref.WeakKeyDictionary()
# Optimizers whose state-dict hooks put a swap back first (a step that raised leaves one).
_WATCHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_installed = False


@dataclass(slots=True)
class _Entry:
    """One DTensor parameter, its local tensor, and its state on both sides."""

    param: DTensor
    local: torch.Tensor  # what the optimizer steps: the parameter's local tensor itself
    state: dict[str, Any] | None  # opt.state[param] as last seen (DTensor values), if any
    state_values: tuple[Any, ...]  # its values then: the ones ``shadow`` mirrors
    shadow: dict[str, Any]  # the state the optimizer sees during a step (local values)
    shadow_values: tuple[Any, ...] = ()  # shadow's values when last mirrored back
    had_grad: bool = False


@dataclass(slots=True)
class _Group:
    group: dict[str, Any]
    params: list[torch.Tensor]  # the group's own list, put back after the step
    members: tuple[torch.Tensor, ...]  # its contents when the plan was made
    stepped: list[torch.Tensor]  # what the step sees: local tensors, plain parameters as is


@dataclass(slots=True)
class _Plan:
    """What one optimizer's steps see in place of its DTensors, and how to put them back."""

    state: defaultdict[torch.Tensor, dict[str, Any]]  # the optimizer's own state table
    shadow: defaultdict[torch.Tensor, dict[str, Any]]  # keyed by local tensors during a step
    groups: list[_Group] = field(default_factory=list)
    entries: list[_Entry] = field(default_factory=list)
    plain: list[torch.Tensor] = field(default_factory=list)  # parameters stepped as they are
    active: bool = False  # between the pre-step and the post-step hook (or a restore)


def allow_local_step(owner: _Owner) -> None:
    """Let optimizers step ``owner``'s sharded parameter (a DTensor) on its local tensor."""
    global _installed
    _ALLOWED[id(owner.sharded_param)] = owner
    if not _installed:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _installed = True


def _before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore(opt)  # a step that raised never reached the post hook
    if type(opt) not in ELEMENTWISE_OPTIMIZERS or torch.compiler.is_compiling():
        return
    plan = _PLANS.get(opt)
    if plan is None or not _plan_holds(plan, opt):
        plan = _build_plan(opt)
        if plan is None:
            _PLANS.pop(opt, None)
            return
        _PLANS[opt] = plan
    if not _take_grads(plan) or not _refresh_state(plan):
        _PLANS.pop(opt, None)  # nothing swapped yet; the step runs on the DTensors
        return
    for g in plan.groups:
        g.group["params"] = g.stepped
    for p in plan.plain:
        # Plain parameters keep their own state dict objects: the step updates them in place.
        kept = plan.state.get(p)
        if kept is None:
            plan.shadow.pop(p, None)
        else:
            plan.shadow[p] = kept
    opt.state = plan.shadow
    plan.active = True
    if opt not in _WATCHED:
        _WATCHED.add(opt)
        opt.register_state_dict_pre_hook(restore)
        opt.register_load_state_dict_pre_hook(_restore_before_load)


def _build_plan(opt: torch.optim.Optimizer) -> _Plan | None:
    """The plan for ``opt`` as its groups are now; None if any parameter's step may differ."""
    plan = _Plan(state=opt.state, shadow=defaultdict(dict))
    for group in opt.param_groups:
        if group.get("differentiable", False):
            return None
        params: list[torch.Tensor] = group["params"]
        stepped: list[torch.Tensor] = []
        for p in params:
            if not isinstance(p, DTensor):
                plan.plain.append(p)  # a plain tensor is stepped as it is either way
                stepped.append(p)
                continue
            owner = _ALLOWED.get(id(p))
            if owner is None or owner.sharded_param is not p or p.dim() == 0:
                return None  # all or nothing: foreach kernels cannot mix the two kinds
            local = local_of(p)
            entry = _Entry(p, local, None, (), {})
            plan.shadow[local] = entry.shadow
            plan.entries.append(entry)
            stepped.append(local)
        plan.groups.append(_Group(group, params, tuple(params), stepped))
    return plan if plan.entries else None


def _plan_holds(plan: _Plan, opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s groups, parameters and local tensors are still those of ``plan``."""
    if opt.state is not plan.state or len(opt.param_groups) != len(plan.groups):
        return False
    for g, group in zip(plan.groups, opt.param_groups, strict=True):
        params = group["params"]
        if (
            group is not g.group
            or params is not g.params
            or group.get("differentiable", False)
            or not _same_objects(params, g.members)
        ):
            return False
    # The engine re-points a parameter at a new local tensor when its buffer moves.
    return all(local_of(e.param) is e.local for e in plan.entries)


def _take_grads(plan: _Plan) -> bool:
    """Give each local tensor its parameter's local gradient.

    Returns False, with nothing left set, if a gradient is not a DTensor of its parameter's
    spec, or not of its dtype (a ``grad_dtype`` set on it): the optimizer then steps the
    DTensors, which accept such a gradient where the local tensor would refuse it.
    """
    entries = plan.entries
    for i, e in enumerate(entries):
        grad = e.param.grad
        e.had_grad = grad is not None
        if grad is None:
            continue
        if not (
            isinstance(grad, DTensor) and same_spec(grad, e.param) and grad.dtype == e.local.dtype
        ):
            for done in entries[:i]:
                done.local.grad = None
            return False
        e.local.grad = local_of(grad)
    return True


def _refresh_state(plan: _Plan) -> bool:
    """Mirror into the shadow table any state that changed since the last step.

    That is the user's writes of whole objects; updates in place need nothing, as the shadow
    holds the DTensors' own local tensors. Returns False, with the gradients taken back, if a
    DTensor value has another spec than its parameter.
    """
    state = plan.state
    for e in plan.entries:
        kept = state.get(e.param)
        if kept is e.state and (kept is None or _same_objects(kept.values(), e.state_values)):
            continue
        values = {} if kept is None else dict(kept)
        if any(isinstance(v, DTensor) and not same_spec(v, e.param) for v in values.values()):
            for done in plan.entries:
                done.local.grad = None
            return False
        e.state = kept
        e.state_values = tuple(values.values())
        e.shadow.clear()
        e.shadow.update(
            {k: local_of(v) if isinstance(v, DTensor) else v for k, v in values.items()}
        )
        e.shadow_values = tuple(e.shadow.values())
    return True


def _same_objects(values: Any, seen: tuple[Any, ...]) -> bool:
    items = tuple(values)
    return len(items) == len(seen) and all(map(operator.is_, items, seen))


def _restore_before_load(opt: torch.optim.Optimizer, state_dict: Any) -> None:
    restore(opt)


def restore_all(params: Iterable[torch.Tensor]) -> None:
    """Put back the swaps still in place (a step raised) of optimizers that step ``params``.

    A root's pre-forward calls it with its own sharded parameters. Only those optimizers:
    another optimizer of the process may be inside its step right now (a model trained
    beside this one, ranks as threads), and taking its swap back mid-step would leave it
    stepping local tensors with no gradients. Between a step that raised and this,
    ``zero_grad`` cleared the local tensors' gradients: the DTensors' are cleared here too,
    so the next backward does not add to stale ones.
    """
    active = [(opt, plan) for opt, plan in list(_PLANS.items()) if plan.active]
    if not active:
        return  # the usual case: the root's parameters are not even listed
    ids = {id(p) for p in params}
    for opt, plan in active:
        if any(id(e.param) in ids for e in plan.entries):
            restore(opt)


def _after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore(opt)


def restore(opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` its DTensor parameters and state back, if a step swapped them."""
    plan = _PLANS.get(opt)
    if plan is None or not plan.active:
        return
    plan.active = False
    opt.state = plan.state
    for g in plan.groups:
        g.group["params"] = g.params
    for p in plan.plain:
        stepped = plan.shadow.get(p)
        if stepped is not None:
            plan.state[p] = stepped  # first state made during the step
    for e in plan.entries:
        if e.had_grad and e.local.grad is None:
            e.param.grad = None  # zero_grad ran on the local tensors (after a failed step)
        e.local.grad = None  # the DTensor's gradient is the one that stays
        shadow = plan.shadow.get(e.local)
        if shadow is not e.shadow:
            # The optimizer replaced the dict: adopt it as the shadow from now on.
            e.shadow = shadow if shadow is not None else {}
            plan.shadow[e.local] = e.shadow
        elif _same_objects(shadow.values(), e.shadow_values):
            continue  # updated in place, the usual case: the DTensors already hold it
        _mirror(plan, e)


def _mirror(plan: _Plan, e: _Entry) -> None:
    """Write the step's new state of ``e`` back as the DTensor state (same dict object)."""
    before = e.state or {}
    values = {k: _as_state(e, before.get(k), v) for k, v in e.shadow.items()}
    kept = e.state if e.state is not None else {}
    kept.clear()
    kept.update(values)
    if kept:
        plan.state[e.param] = kept
        e.state = kept
    e.state_values = tuple(kept.values())
    e.shadow_values = tuple(e.shadow.values())


def _as_state(entry: _Entry, before: Any, value: Any) -> Any:
    """One state value of a parameter as the optimizer would have kept it on DTensors."""
    if isinstance(before, DTensor) and local_of(before) is value:
        return before  # updated in place: the same object as before
    if (
        type(value) is torch.Tensor
        and value.dim() > 0
        and value.shape == entry.local.shape
        and value.device == entry.local.device
    ):
        # New state shaped like the parameter (zeros_like(param) on DTensors): a DTensor.
        return dtensor_like(value, entry.param)
    return value  # scalars such as Adam's step are plain tensors on DTensors too
