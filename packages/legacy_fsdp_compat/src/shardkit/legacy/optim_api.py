"""FSDP1's optimizer-state static methods, on :mod:`shardkit.legacy.optim_state`.

``optim_state_dict`` / ``optim_state_dict_to_load`` follow the model's ``state_dict_type``;
the older ``full_``, ``sharded_``, ``shard_full_``, ``flatten_sharded_`` and
``scatter_full_optim_state_dict`` name their form. ``rekey_optim_state_dict`` switches the
keys between names and positions (for models FSDP does not wrap too).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.legacy import configs
from shardkit.legacy.configs import OptimStateKeyType, StateDictType
from shardkit.legacy.optim_keys import names_by_param, params_by_id, params_of_input
from shardkit.legacy.optim_state import SaveForm, load_ready, named_state, receive_from_first
from shardkit.legacy.orig_params import repoint
from shardkit.legacy.settings import get_state_dict_type
from shardkit.legacy.torch_compat import translate
from shardkit.legacy.units import unit_of, units_in

__all__ = [
    "flatten_sharded_optim_state_dict",
    "full_optim_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]

_OURS = {name: getattr(configs, name) for name in configs.__all__}


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"``FullyShardedDataParallel.{old}``is being deprecated and is replaced by "
        f"``FullyShardedDataParallel.{new}``.",
        FutureWarning,
        stacklevel=3,
    )


def _device_mesh_given(model: nn.Module) -> bool:
    return any(unit_of(w).unit.device_mesh_given for w in units_in(model))


def _two_d_mesh(model: nn.Module) -> DeviceMesh | None:
    units = [unit_of(w).unit for w in units_in(model)]
    return next((u.mesh for u in units if u.two_d), None)


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim``'s state keyed by parameter names, in the form of the model's state-dict type.

    FULL: full tensors (the optimizer config's ``rank0_only`` and ``offload_to_cpu``);
    SHARDED: this rank's shards. Every rank must call it.
    """
    settings = get_state_dict_type(model)
    config = settings.optim_state_dict_config
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    form = SaveForm(
        full=full,
        rank0_only=full and bool(getattr(config, "rank0_only", False)),
        offload_to_cpu=config.offload_to_cpu,
        use_dtensor=bool(getattr(config, "_use_dtensor", False)) or _device_mesh_given(model),
        two_d_mesh=_two_d_mesh(model),
    )
    repoint(optim)
    osd = optim_state_dict if optim_state_dict is not None else optim.state_dict()
    return named_state(model, params_by_id(optim), osd, form, group)


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """A name-keyed optimizer state dict (full or sharded) ready for ``optim.load_state_dict``.

    With FULL and the optimizer config's ``rank0_only``, only rank 0's dict is read and it
    is broadcast. ``is_named_optimizer`` is accepted (shardkit keys by the optimizer's own
    parameters either way). ``load_directly`` also loads it.
    """
    del is_named_optimizer
    repoint(optim)
    settings = get_state_dict_type(model)
    rank0_only = bool(getattr(settings.optim_state_dict_config, "rank0_only", False))
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT and rank0_only:
        optim_state_dict = receive_from_first(
            optim_state_dict if dist.get_rank(group) == 0 else None, group
        )
    result = load_ready(model, optim, optim_state_dict)
    if load_directly:
        optim.load_state_dict(result)
    return result


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Iterable[Any] | None = None,
    rank0_only: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Full, name-keyed optimizer state (on rank 0 only by default); FSDP1's legacy API."""
    _deprecated("full_optim_state_dict", "optim_state_dict")
    repoint(optim)
    params = params_by_id(optim) if optim_input is None else params_of_input(model, optim_input)
    form = SaveForm(full=True, rank0_only=rank0_only, offload_to_cpu=True)
    return named_state(model, params, optim.state_dict(), form, group)


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """This rank's shards of the optimizer state, name-keyed; FSDP1's legacy API."""
    _deprecated("sharded_optim_state_dict", "optim_state_dict")
    repoint(optim)
    form = SaveForm(
        full=False,
        offload_to_cpu=True,
        use_dtensor=_device_mesh_given(model),
        two_d_mesh=_two_d_mesh(model),
    )
    return named_state(model, params_by_id(optim), optim.state_dict(), form, group)


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """A full optimizer state dict (on every rank) ready to load; FSDP1's legacy API."""
    _deprecated("shard_full_optim_state_dict", "optim_state_dict_to_load")
    return load_ready(model, _optimizer_for(model, optim, optim_input), full_optim_state_dict)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """A sharded optimizer state dict ready to load; FSDP1's legacy API."""
    _deprecated("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    repoint(optim)
    return load_ready(model, optim, sharded_optim_state_dict)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any | None = None,
) -> dict[str, Any]:
    """Rank 0's full optimizer state dict, sent to every rank, ready to load (legacy API)."""
    _deprecated("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    full = receive_from_first(full_optim_state_dict, group)
    return load_ready(model, _optimizer_for(model, optim, optim_input), full)


def _optimizer_for(
    model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Iterable[Any] | None
) -> torch.optim.Optimizer:
    if optim is not None:
        repoint(optim)
        return optim
    # FSDP1 without an optimizer: positions are those of optim_input, or of the parameters.
    groups = list(optim_input) if optim_input is not None else None
    if groups and all(isinstance(g, dict) for g in groups):
        return torch.optim.SGD(groups, lr=0.0)
    return torch.optim.SGD(params_of_input(model, groups), lr=0.0)


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """The same optimizer state dict keyed by names (PARAM_NAME) or positions (PARAM_ID).

    Each param group's ``params`` come sorted, as FSDP1's. Works for models FSDP wraps and
    models it does not (the usual use: moving state between the two).

    Raises:
        ValueError: the keys mix names and positions.
    """
    key_type = translate(optim_state_key_type, _OURS)
    keys = list(optim_state_dict["state"])
    named = [isinstance(k, str) for k in keys]
    if any(named) and not all(named):
        raise ValueError(f"Invalid parameter keys: {optim_state_dict['state'].keys()}")
    if (key_type is OptimStateKeyType.PARAM_NAME) == (all(named) and bool(keys)) or not keys:
        return optim_state_dict
    if optim is not None:
        repoint(optim)
    params = params_by_id(optim) if optim is not None else params_of_input(model, optim_input)
    names = names_by_param(model)
    name_of = [names[id(p)] for p in params]
    if key_type is OptimStateKeyType.PARAM_NAME:
        mapping: dict[Any, Any] = dict(enumerate(name_of))
    else:
        mapping = {name: position for position, name in enumerate(name_of)}
    rekeyed = {"state": {mapping[k]: v for k, v in optim_state_dict["state"].items()}}
    groups = copy.deepcopy(optim_state_dict["param_groups"])
    for group in groups:
        group["params"] = sorted(mapping[k] for k in group["params"])
    rekeyed["param_groups"] = groups
    return rekeyed
