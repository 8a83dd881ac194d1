"""``Join``'s keyword arguments for an FSDP root, validated (``engine/join`` makes the hook).

torch's ``Join`` passes the same keyword arguments to every joinable's ``join_hook``; the FSDP
root's takes ``optimizer`` (required), ``lr_scheduler`` and ``divide_by_initial_world_size``,
and leaves the others to the joinables they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.state_registry import state_of, states_under

__all__ = ["JoinArgs", "join_args", "root_name"]


@dataclass(frozen=True, slots=True)
class JoinArgs:
    """What the FSDP join hook is made with."""

    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler | None
    divide_by_initial_world_size: bool


def join_args(module: nn.Module, kwargs: dict[str, Any]) -> JoinArgs:
    """Validate ``Join``'s keyword arguments for the root FSDP module ``module``.

    Args:
        module: the root FSDP module.
        kwargs: ``Join``'s, shared by its joinables: ``optimizer`` (required: each rank
            updates the shards it owns), ``lr_scheduler`` (stepped after it, if given) and
            ``divide_by_initial_world_size`` (default True); others are another joinable's.

    Raises:
        RuntimeError: ``module`` is not managed by ``fully_shard``, or is not a root.
        ValueError: no optimizer, one that does not hold the module's parameters, or a
            module with no parameters.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or ``lr_scheduler`` no
            ``LRScheduler``.
    """
    state = state_of(module)
    name = root_name(module)
    if state.is_root is False:
        raise RuntimeError(
            f"Join: FSDP module {name} is not the root; pass the root module (the outermost "
            "fully_shard) to Join"
        )
    optimizer = kwargs.get("optimizer")
    if optimizer is None:
        raise ValueError(
            f"Join([{name}], optimizer=...): FSDP's join hook needs the optimizer, since each "
            "rank updates the shards it owns while the others still train"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Join: optimizer for FSDP module {name} must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    groups = [g for s in states_under(module) for g in s.groups]
    if not groups:
        raise ValueError(f"Join: FSDP module {name} has no sharded parameters")
    _check_optimizer_holds(optimizer, groups, name)
    scheduler = kwargs.get("lr_scheduler")
    if scheduler is not None and not isinstance(scheduler, LRScheduler):
        raise TypeError(
            f"Join: lr_scheduler for FSDP module {name} must be a torch.optim.lr_scheduler."
            f"LRScheduler, got {type(scheduler).__name__}"
        )
    divide = bool(kwargs.get("divide_by_initial_world_size", True))
    return JoinArgs(optimizer, scheduler, divide)


def root_name(module: nn.Module) -> str:
    """How errors name the module: its FQN, or its class for the root."""
    fqn = state_of(module).fqn
    return fqn if fqn and fqn != "<root>" else type(module).__name__


def _check_optimizer_holds(
    optimizer: torch.optim.Optimizer, groups: list[FSDPParamGroup], name: str
) -> None:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [
        p.fqn
        for g in groups
        for p in g.params
        if p.requires_grad and id(p.sharded_param) not in held
    ]
    if missing:
        raise ValueError(
            f"Join: the optimizer does not hold FSDP module {name}'s parameters "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; a joined rank steps it on them"
        )
