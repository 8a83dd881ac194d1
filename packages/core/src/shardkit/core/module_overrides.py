"""What ``FSDPModule``'s overrides of ``nn.Module``'s own methods do to a sharded module.

An ``FSDP<Cls>`` keeps ``nn.Module``'s methods but three: construction (a module built from
its class is a plain module of the original class, :func:`new_plain_module`), and the two
that replace its tensors, which must know of its parameter groups: ``_apply`` (``.to()``,
``.to_empty()``, ``.float()``: the groups reshard first and take up the new tensors after,
:func:`apply_resharded`) and ``load_state_dict`` (all of it or nothing, agreed across ranks,
:func:`load_all_or_nothing`). ``FSDPModule`` keeps the methods, with their docstrings, and
calls these functions. Split out of ``fsdp_module``, whose own methods are FSDP's (unshard,
the ``set_*`` options).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardkit.core.engine.grad_dtype_policy import hold_explicit_grads, restore_held_grads
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.runtime.p2p.agreement import agreed
from shardkit.core.state_dict.validation import (
    check_state_dict,
    format_problems,
    model_mesh,
    param_keys,
    shard_full_tensors,
)

__all__ = ["apply_resharded", "load_all_or_nothing", "new_plain_module"]


def new_plain_module(
    cls: type, fsdp_base: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A module of ``cls``'s original class, built with ``args`` and ``kwargs``.

    The original class is the first in ``cls``'s MRO that is a module and no ``fsdp_base``.
    """
    # The first module class that is not an FSDP class (torch's FSDPModule base, which
    # FSDP<Cls> also has, is no module).
    original = next(
        c for c in cls.__mro__ if issubclass(c, nn.Module) and not issubclass(c, fsdp_base)
    )
    if original.__new__ is object.__new__:
        module = object.__new__(original)
    else:
        module = original.__new__(original, *args, **kwargs)
    original.__init__(module, *args, **kwargs)
    return module


def apply_resharded(
    module: nn.Module,
    groups: list[FSDPParamGroup],
    fn: Callable[[torch.Tensor], torch.Tensor],
    recurse: bool,
) -> Any:
    """``nn.Module._apply(module, fn, recurse)`` with every group under ``module`` kept whole.

    ``groups`` are resharded before and take up the new tensors after; gradients whose dtype a
    set ``grad_dtype`` decides keep it (``grad_dtype_policy``).
    """
    # .to(), .to_empty(), .float() replace local tensors: reshard first, re-adopt after.
    for group in groups:
        group.reshard()
    # Parameters an adapter keeps off _parameters (param_listing) move with the rest.
    unlisted = [g for g in groups if not all(p.listed for p in g.params)]
    for group in unlisted:
        group.list_params(True)
    held = hold_explicit_grads(p for group in groups for p in group.params)
    try:
        result = nn.Module._apply(module, fn, recurse)
    finally:
        for group in unlisted:
            group.list_params(False)
    for group in groups:
        group.resync_sharded_storage()
    restore_held_grads(held)
    return result


def load_all_or_nothing(
    module: nn.Module,
    groups: list[FSDPParamGroup],
    state_dict: Mapping[str, Any],
    *,
    strict: bool,
    assign: bool,
) -> Any:
    """``nn.Module.load_state_dict`` of ``module``, once every value passed on every rank.

    ``groups``: every group under ``module``; their meshes' ranks check together, so one
    error is raised on all of them or none loads. See [Note: agreed loads].
    """
    expected = module.state_dict(keep_vars=True)
    by_key = {key: g.params[i] for key, (g, i) in param_keys(module, groups, expected).items()}
    cpu_only = any(g.plan.offload for g in groups)

    def checked() -> dict[str, Any]:
        problems = check_state_dict(expected, state_dict, strict=strict, cpu_only=cpu_only)
        if problems:
            raise RuntimeError(format_problems(module, problems))
        return shard_full_tensors(state_dict, by_key)

    converted = agreed(checked, model_mesh(groups))
    return nn.Module.load_state_dict(module, converted, strict=strict, assign=assign)
