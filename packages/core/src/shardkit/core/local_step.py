"""Optimizer steps on the local tensors of sharded parameters.

See [Note: local optimizer step]. Every operator on a DTensor goes through DTensor's
dispatcher (about 15 us of CPU each on this machine), and an elementwise optimizer runs
several per parameter: on a model of many small parameters that is most of a step. For the
optimizers whose update is elementwise, the DTensor result is the local result, so a global
pre-step hook hands the optimizer each parameter's local tensor (with its gradient and state
local too), and the post-step hook puts the DTensors back. Outside ``step()`` the optimizer
and its state dict see DTensors, exactly as before.
"""

from __future__ import annotations

import weakref
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
    {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW}
)


class _Owner(Protocol):
    """What holds a sharded parameter (an FSDPParam)."""

    @property
    def sharded_param(self) -> torch.Tensor: ...


# The holders of the sharded parameters whose local tensor the engine owns (a view of a
# group's buffer), by the parameter's id. Weak references to the holders, not the parameters:
# torch.utils.swap_tensors (module._apply) refuses a tensor that has a weak reference.
_ALLOWED: weakref.WeakValueDictionary[int, _Owner] = weakref.WeakValueDictionary()
_SWAPPED: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Swap] = weakref.WeakKeyDictionary()
# Optimizers whose state-dict hooks put a swap back first (a step that raised leaves one).
_WATCHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_installed = False


@dataclass(slots=True)
class _Entry:
    param: torch.Tensor  # the DTensor parameter
    local: torch.Tensor  # its local tensor, what the optimizer steps
    had_grad: bool
    state: dict[str, Any]  # the parameter's state dict object, as it was (DTensor values)


@dataclass(slots=True)
class _Swap:
    """What one optimizer's step sees in place of its DTensors, and how to put them back."""

    params: list[tuple[dict[str, Any], list[torch.Tensor]]] = field(default_factory=list)
    """Each param group and its own list of parameters."""
    entries: list[_Entry] = field(default_factory=list)


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
    # One pass: swap as we go, and put everything back if a parameter does not qualify.
    swap = _SWAPPED[opt] = _Swap()
    state = opt.state
    for group in opt.param_groups:
        params: list[torch.Tensor] = group["params"]
        stepped: list[torch.Tensor] = []
        swap.params.append((group, params))
        group["params"] = stepped
        if group.get("differentiable", False):
            restore(opt)
            return
        for p in params:
            if not isinstance(p, DTensor):
                stepped.append(p)  # a plain tensor is stepped as it is either way
                continue
            entry = _swap_in(p, state)
            if entry is None:
                restore(opt)  # all or nothing: foreach kernels cannot mix the two kinds
                return
            swap.entries.append(entry)
            stepped.append(entry.local)
    if not swap.entries:
        restore(opt)
        return
    if opt not in _WATCHED:
        _WATCHED.add(opt)
        opt.register_state_dict_pre_hook(restore)
        opt.register_load_state_dict_pre_hook(_restore_before_load)


def _swap_in(p: DTensor, state: dict[Any, Any]) -> _Entry | None:
    """Key ``p``'s gradient and state by its local tensor; None if its step may differ."""
    owner = _ALLOWED.get(id(p))
    if owner is None or owner.sharded_param is not p or p.dim() == 0:
        return None
    grad = p.grad
    if grad is not None and not (isinstance(grad, DTensor) and same_spec(grad, p)):
        return None
    kept: dict[str, Any] = state.get(p, {})
    if any(isinstance(v, DTensor) and not same_spec(v, p) for v in kept.values()):
        return None
    local = local_of(p)
    local.grad = None if grad is None else local_of(grad)
    if kept:
        del state[p]
        state[local] = {k: local_of(v) if isinstance(v, DTensor) else v for k, v in kept.items()}
    return _Entry(p, local, grad is not None, kept)


def _restore_before_load(opt: torch.optim.Optimizer, state_dict: Any) -> None:
    restore(opt)


def restore_all() -> None:
    """Put back every swap still in place (a step raised); the engine's next forward calls it.

    Between a step that raised and this, ``zero_grad`` cleared the local tensors' gradients:
    the DTensors' are cleared here too, so the next backward does not add to stale ones.
    """
    for opt in list(_SWAPPED.keys()):
        restore(opt)


def _after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore(opt)


def restore(opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` its DTensor parameters and state back, if a step swapped them."""
    swap = _SWAPPED.pop(opt, None)
    if swap is None:
        return
    for group, params in swap.params:
        group["params"] = params
    state = opt.state
    for entry in swap.entries:
        if entry.had_grad and entry.local.grad is None:
            entry.param.grad = None  # zero_grad ran on the local tensors (after a failed step)
        entry.local.grad = None  # the DTensor's gradient is the one that stays
        stepped = state.pop(entry.local, None)
        if stepped is None:
            if entry.state:
                state[entry.param] = entry.state
            continue
        values = {k: _as_state(entry, k, v) for k, v in stepped.items()}
        # The parameter's own state dict object, refilled: references to it stay valid.
        kept = entry.state
        kept.clear()
        kept.update(values)
        state[entry.param] = kept


def _as_state(entry: _Entry, key: str, value: Any) -> Any:
    """One state value of a parameter as the optimizer would have kept it on DTensors."""
    before = entry.state.get(key)
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
