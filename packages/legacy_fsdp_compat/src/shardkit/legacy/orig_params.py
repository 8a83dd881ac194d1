"""An optimizer built before the wrapper trains the wrapped model, as FSDP1's optimizers do.

FSDP1 (``use_orig_params=True``) keeps each module's ``Parameter`` objects and points their
data into its flat shard, so an optimizer built before wrapping (Accelerate's
``prepare(model, optimizer)`` builds them in that order) goes on training the model. The
engine puts new ``Parameter`` objects (sharded DTensors) on the modules instead; the old ones
live on only where something still holds them. Left alone, such an optimizer would update
tensors the model no longer uses, silently.

So each wrapper records the parameters it replaces (weakly), and at the root's first forward,
before any step can run, every live optimizer that holds one gets its replacement in its
place: the same position in the same param group. An optimizer that already has state for a
replaced parameter (it stepped, or loaded a state dict, before the wrapper existed) is refused
by name: that state is of the full tensor, not of a shard. A step of an optimizer that still
holds a replaced parameter after that (one built later, from a list taken before wrapping)
raises rather than training the old tensors.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["record_replaced", "repoint", "repoint_optimizers"]


@dataclass(frozen=True, slots=True)
class _Replaced:
    """A parameter the engine replaced, and where its replacement lives."""

    original: weakref.ref[nn.Parameter]
    module: weakref.ref[nn.Module]
    name: str
    """Its attribute name on ``module``."""
    label: str
    """How messages name it (the module's class and the attribute)."""

    def replacement(self) -> nn.Parameter | None:
        value = getattr(self.module(), self.name, None)
        return value if isinstance(value, nn.Parameter) else None


# By id of the original parameter; entries leave when the original is collected.
_REPLACED: dict[int, _Replaced] = {}
_hook_installed = False


def record_replaced(modules: list[nn.Module], skip: set[nn.Parameter]) -> None:
    """Remember the parameters of ``modules`` (but ``skip``) that sharding is about to replace.

    Call right before ``fully_shard``: afterwards each module holds the replacement under the
    same attribute name.
    """
    global _hook_installed
    for module in modules:
        for name, param in module.named_parameters(recurse=False):
            if param in skip or id(param) in _REPLACED:
                continue
            key = id(param)
            _REPLACED[key] = _Replaced(
                original=weakref.ref(param, _forget(key)),
                module=weakref.ref(module),
                name=name,
                label=f"{type(module).__name__}.{name}",
            )
    if not _hook_installed:
        register_optimizer_step_pre_hook(_refuse_replaced)
        _hook_installed = True


def _forget(key: int) -> Callable[[object], None]:
    """A weakref callback that drops the record of ``key`` once its parameter is collected."""

    def drop(_: object) -> None:
        _REPLACED.pop(key, None)

    return drop


def _held(param: Any) -> _Replaced | None:
    """The record of ``param`` if it is a replaced original (still that very object)."""
    entry = _REPLACED.get(id(param))
    return entry if entry is not None and entry.original() is param else None


def repoint_optimizers(root: nn.Module) -> int:
    """Give every live optimizer the replacements of ``root``'s replaced parameters it holds.

    Args:
        root: the root wrapper; parameters replaced in other models are not its business.

    Returns:
        How many parameter slots were re-pointed.

    Raises:
        RuntimeError: an optimizer has state for a replaced parameter; nothing is changed in
            that optimizer.
    """
    if not _REPLACED:
        return 0
    mine = {id(m) for m in root.modules()}
    moved = 0
    # One pass over the heap, once per root: optimizers are not registered anywhere else.
    # type() rather than isinstance: isinstance reads __class__, which some objects compute
    # (torch's deprecated reduce_op warns on it).
    optimizers = [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]
    for opt in optimizers:
        moved += repoint(opt, within=mine)
    return moved


def repoint(opt: torch.optim.Optimizer, within: set[int] | None = None) -> int:
    """Give ``opt`` the replacements of the replaced parameters it holds (see the module).

    The optimizer-state APIs call it on the optimizer they are given: a checkpoint may be
    loaded before the first forward.

    Args:
        opt: the optimizer.
        within: only parameters replaced on these modules (by id); default: any.

    Returns:
        How many parameter slots were re-pointed.

    Raises:
        RuntimeError: ``opt`` has state for a replaced parameter; nothing is changed.
    """
    if not _REPLACED:
        return 0
    slots = [
        (group["params"], i, entry)
        for group in opt.param_groups
        for i, p in enumerate(group["params"])
        if (entry := _held(p)) is not None and (within is None or id(entry.module()) in within)
    ]
    for params, i, entry in slots:
        if opt.state.get(params[i]):
            raise RuntimeError(
                f"{type(opt).__name__} has optimizer state for {entry.label} from before "
                "FullyShardedDataParallel replaced that parameter with its sharded one; the "
                "state is of the full tensor. Load optimizer state after wrapping (with "
                "FSDP.optim_state_dict_to_load), or build the optimizer after wrapping"
            )
    for params, i, entry in slots:
        replacement = entry.replacement()
        if replacement is not None:
            opt.state.pop(params[i], None)
            params[i] = replacement
    return len(slots)


def _refuse_replaced(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook: never train a parameter the wrapper replaced."""
    if not _REPLACED:
        return
    for group in opt.param_groups:
        for p in group["params"]:
            entry = _held(p)
            if entry is not None:
                raise RuntimeError(
                    f"{type(opt).__name__} steps {entry.label}, a parameter that "
                    "FullyShardedDataParallel replaced with a sharded one after this optimizer "
                    "took it: the step would train a tensor the model no longer uses. Build "
                    "the optimizer from model.parameters() after wrapping"
                )
