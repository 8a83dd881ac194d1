"""Which parameter an optimizer-state entry belongs to: by position (ID) or by name.

``torch.optim.Optimizer.state_dict()`` keys state by position in its param groups; a named
optimizer (torch's ``_NamedOptimizer``, torchrec's ``KeyedOptimizer``) by the parameter's name
as the model spells it (``_fsdp_wrapped_module.`` included); FSDP1's optimizer APIs key it by
the parameter's clean name (FQN). All are read off the optimizer and the model here, nothing
else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from shardkit.legacy.flat_params import per_parameter_view
from shardkit.legacy.torch_compat import clean_name

__all__ = ["is_named_state", "keyed_params", "names_by_param", "params_by_id", "params_of_input"]

ParamKey = int | str
"""What an optimizer state dict keys a parameter by: its position, or its name (named)."""


def params_by_id(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters; position = the ID its ``state_dict()`` uses."""
    return [p for group in optim.param_groups for p in group["params"]]


def params_of_input(model: nn.Module, optim_input: Iterable[Any] | None) -> list[torch.Tensor]:
    """FSDP1's legacy ``optim_input`` (params or param-group dicts) as positions.

    Without it, the model's parameters in ``model.parameters()`` order, as FSDP1 assumes.
    """
    if optim_input is None:
        return list(model.parameters())
    params: list[torch.Tensor] = []
    for item in optim_input:
        if isinstance(item, dict):
            params.extend(item["params"])
        else:
            params.append(item)
    return params


def is_named_state(osd: Mapping[str, Any]) -> bool:
    """Whether ``osd`` is keyed by names (a named optimizer's), as FSDP1 decides: its first key.

    An empty state says nothing; it is taken for positions, as FSDP1 takes it.
    """
    state: Mapping[Any, Any] = osd.get("state") or {}
    return bool(state) and isinstance(next(iter(state)), str)


def keyed_params(
    optim: torch.optim.Optimizer, model: nn.Module, named: bool = False
) -> dict[ParamKey, torch.Tensor]:
    """``optim``'s parameters by the keys its ``state_dict()`` uses.

    Positions; with ``named``, each parameter's name in ``model.named_parameters()`` (its
    first, for a tied one), which is how a named optimizer built on that model keys it.

    Raises:
        KeyError: ``named`` and one of ``optim``'s parameters is not ``model``'s.
    """
    params = params_by_id(optim)
    if not named:
        return dict(enumerate(params))
    spelled: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # flat ones, if any
        spelled.setdefault(id(param), name)
    keyed: dict[ParamKey, torch.Tensor] = {}
    for position, tensor in enumerate(params):
        if id(tensor) not in spelled:
            raise KeyError(
                f"{type(optim).__name__}'s parameter {position} is not one of "
                f"{type(model).__name__}'s parameters, so it has no name to key its state by"
            )
        keyed[spelled[id(tensor)]] = tensor
    return keyed


def names_by_param(model: nn.Module) -> dict[int, str]:
    """Each parameter's clean name (a tied parameter: its first), by ``id``."""
    names: dict[int, str] = {}
    with per_parameter_view():  # FSDP1's saved forms name the original parameters
        named = list(model.named_parameters(remove_duplicate=False))
    for name, param in named:
        names.setdefault(id(param), clean_name(name))
    return names
