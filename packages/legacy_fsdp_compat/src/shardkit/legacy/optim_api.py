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
from shardkit.legacy.comm import gather_objects, mesh_ranks_group, raise_alike
from shardkit.legacy.configs import OptimStateKeyType, StateDictType
from shardkit.legacy.flat_optim import PerParameter, per_parameter
from shardkit.legacy.flat_params import flat_of
from shardkit.legacy.optim_keys import (
    ParamKey,
    is_named_state,
    keyed_params,
    names_by_param,
    params_by_id,
    params_of_input,
)
from shardkit.legacy.optim_state import (
    SaveForm,
    load_ready,
    loadable,
    named_state,
    receive_from_first,
)
from shardkit.legacy.orig_params import repoint
from shardkit.legacy.settings import get_state_dict_type
from shardkit.legacy.torch_compat import clean_name, translate
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


def _warn_optim_input(optim_input: object) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated: the positions are those of the "
            "optimizer's own param groups. Leave it out; nothing else changes.",
            FutureWarning,
            stacklevel=3,
        )


def _positions(
    model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Iterable[Any] | None
) -> dict[ParamKey, torch.Tensor]:
    """Parameters by position, from ``optim_input`` if given (or no ``optim``), as FSDP1."""
    if optim_input is not None or optim is None:
        return dict(enumerate(params_of_input(model, optim_input)))
    return dict(enumerate(params_by_id(optim)))


def _ready_to_load(
    model: nn.Module,
    per: PerParameter,
    osd: dict[str, Any],
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """``per.collapse(load_ready(...))``, raised alike on every rank of the model.

    Input read from outside may be bad on some ranks only: each rank checks its own before
    any tensor moves, and the ranks agree that they will run the same collectives (every
    value gathered on one is gathered on all) before converting.
    """
    if group is None and (units := units_in(model)):
        group = mesh_ranks_group(unit_of(units[0]).unit.mesh)
    gathered: list[str] = []
    error: Exception | None = None
    try:
        gathered = loadable(model, per.keyed, osd)
    except (TypeError, KeyError, ValueError) as problem:
        error = problem
    raise_alike(error, group)
    plans = gather_objects(gathered, group)
    if any(plan != plans[0] for plan in plans):
        differ = [rank for rank, plan in enumerate(plans) if plan != plans[0]]
        raise ValueError(
            f"the optimizer state dicts given to the ranks differ in layout: rank(s) {differ} "
            "hold DTensors laid out unlike their parameters where the first rank does not "
            "(or the reverse); nothing was loaded"
        )
    result: dict[str, Any] = {}
    error = None
    try:
        result = per.collapse(load_ready(model, per.keyed, osd))
    except (KeyError, ValueError) as problem:
        error = problem
    raise_alike(error, group)
    return result


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
    per = per_parameter(keyed_params(optim, model, named=is_named_state(osd)))
    return named_state(model, per.keyed, per.expand(osd), form, group)


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
    repoint(optim)
    settings = get_state_dict_type(model)
    rank0_only = bool(getattr(settings.optim_state_dict_config, "rank0_only", False))
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT and rank0_only:
        optim_state_dict = receive_from_first(
            optim_state_dict if dist.get_rank(group) == 0 else None, group
        )
    per = per_parameter(keyed_params(optim, model, named=is_named_optimizer))
    result = _ready_to_load(model, per, optim_state_dict, group)
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
    _warn_optim_input(optim_input)
    repoint(optim)
    osd = optim.state_dict()
    if optim_input is None:
        keyed = keyed_params(optim, model, named=is_named_state(osd))
    else:
        keyed = _positions(model, optim, optim_input)
    form = SaveForm(full=True, rank0_only=rank0_only, offload_to_cpu=True)
    per = per_parameter(keyed)
    return named_state(model, per.keyed, per.expand(osd), form, group)


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
    osd = optim.state_dict()
    per = per_parameter(keyed_params(optim, model, named=is_named_state(osd)))
    return named_state(model, per.keyed, per.expand(osd), form, group)


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """A full optimizer state dict (on every rank) ready to load; FSDP1's legacy API."""
    _deprecated("shard_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    if optim is not None:
        repoint(optim)
    per = per_parameter(_positions(model, optim, optim_input))
    return _ready_to_load(model, per, full_optim_state_dict, None)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """A sharded optimizer state dict ready to load; FSDP1's legacy API."""
    _deprecated("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    repoint(optim)
    per = per_parameter(_positions(model, optim, None))
    return _ready_to_load(model, per, sharded_optim_state_dict, None)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any | None = None,
) -> dict[str, Any]:
    """Rank 0's full optimizer state dict, sent to every rank, ready to load (legacy API)."""
    _deprecated("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    if optim is not None:
        repoint(optim)
    full = receive_from_first(full_optim_state_dict, group)
    per = per_parameter(_positions(model, optim, optim_input))
    return _ready_to_load(model, per, full, group)


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
    _warn_optim_input(optim_input)
    key_type = translate(optim_state_key_type, _OURS)
    keys = list(optim_state_dict["state"])
    named = [isinstance(k, str) for k in keys]
    if any(named) and not all(named):
        raise ValueError(f"Invalid parameter keys: {optim_state_dict['state'].keys()}")
    if (key_type is OptimStateKeyType.PARAM_NAME) == (all(named) and bool(keys)) or not keys:
        return optim_state_dict
    if optim is not None:
        repoint(optim)
    names = names_by_param(model)
    # A flat parameter (use_orig_params=False) goes by its own name, `_flat_param` included.
    names |= {id(p): clean_name(n) for n, p in model.named_parameters() if flat_of(p)}
    name_of = {
        position: names[id(p)] for position, p in _positions(model, optim, optim_input).items()
    }
    if key_type is OptimStateKeyType.PARAM_NAME:
        mapping: dict[Any, Any] = name_of
    else:
        mapping = {name: position for position, name in name_of.items()}
    rekeyed = {"state": {mapping[k]: v for k, v in optim_state_dict["state"].items()}}
    if "param_groups" in optim_state_dict:
        groups = copy.deepcopy(optim_state_dict["param_groups"])
        for group in groups:
            group["params"] = sorted(mapping[k] for k in group["params"])
        rekeyed["param_groups"] = groups
    return rekeyed
