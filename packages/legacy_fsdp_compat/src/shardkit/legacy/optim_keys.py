"""Which parameter an optimizer-state entry belongs to: by position (ID) or by name.

``torch.optim.Optimizer.state_dict()`` keys state by position in its param groups; FSDP1's
optimizer APIs key it by the parameter's clean name (FQN). Both are read off the optimizer
and the model here, nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardkit.legacy.torch_compat import clean_name

__all__ = ["names_by_param", "params_by_id", "params_of_input"]


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


def names_by_param(model: nn.Module) -> dict[int, str]:
    """Each parameter's clean name (a tied parameter: its first), by ``id``."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), clean_name(name))
    return names
