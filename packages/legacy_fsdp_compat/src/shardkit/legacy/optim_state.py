"""Optimizer state in FSDP1's forms, both ways.

Saving turns ``optim.state_dict()`` (keyed by position, each state tensor a DTensor shaped
like its parameter) into FSDP1's: keyed by parameter name, each tensor full (FULL) or this
rank's shard (SHARDED: a ShardedTensor, or a DTensor with a device mesh), scalars such as
``step`` as they are, every param group's hyperparameters kept. Loading goes back: each
value becomes this rank's shard as a DTensor like its parameter, keyed by the position this
optimizer gives the parameter, ready for ``optim.load_state_dict``.

Tensors are converted one at a time, in the same order on every rank (a full tensor is
gathered with a collective), so no rank holds more than one full tensor beyond the result.

Next to split off: the first rank's broadcast of a full optimizer state dict
(``receive_from_first``, ``_TensorSpec``, ``_skeleton``) into ``optim_broadcast.py``: it moves a
name-keyed dict as it is, through ``comm``'s broadcasts, shares no helper with the keying and
sharding above, and ``optim_api`` is its one caller.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from shardkit.legacy.comm import broadcast, broadcast_object, gather_objects
from shardkit.legacy.configs import ShardingStrategy
from shardkit.legacy.optim_keys import ParamKey, names_by_param
from shardkit.legacy.sharded_state_dict import (
    check_chunk,
    chunk_2d,
    chunk_like,
    chunk_replicated,
    gather_chunks,
    is_chunked_whole,
    is_sharded,
    local_of_loaded,
    placed_as,
)
from shardkit.legacy.torch_compat import ShardedTensor
from shardkit.legacy.units import unit_of, units_in

__all__ = ["SaveForm", "load_ready", "loadable", "named_state", "receive_from_first"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveForm:
    """What FSDP1's optimizer state dict should look like."""

    full: bool
    """Full tensors (FULL) or this rank's shards (SHARDED)."""
    rank0_only: bool = False
    """FULL only: the other ranks get an empty dict."""
    offload_to_cpu: bool = True
    """Tensors on the CPU."""
    use_dtensor: bool = False
    """SHARDED only: DTensors instead of ShardedTensors."""
    two_d_mesh: DeviceMesh | None = None
    """SHARDED of a 2D (FSDP x TP) model: the data-parallel mesh FSDP1's extension shards on."""


def _saved(value: Any, form: SaveForm, no_shard_meshes: frozenset[int]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor) and not is_sharded(value):
        # Every rank holds it whole: the live state, as FSDP1's NO_SHARD hands it out (its
        # cut below is a copy).
        whole = value.to_local()
        if form.full or id(value.device_mesh) not in no_shard_meshes or value.dim() == 0:
            value = whole
        else:  # FSDP1 cuts NO_SHARD's state across the unit's ranks all the same
            value = chunk_replicated(whole, value, as_dtensor=form.use_dtensor)
    elif isinstance(value, DTensor):
        if form.full:
            value = value.full_tensor()
        elif form.two_d_mesh is not None:
            value = chunk_2d(value.full_tensor(), value, form.two_d_mesh)
        elif not form.use_dtensor:
            value = chunk_like(value.full_tensor(), value)
        else:
            value = value.detach()
    else:
        value = value.detach().clone()  # `step`: never the live tensor the optimizer bumps
    return value.cpu() if form.offload_to_cpu else value


def named_state(
    model: nn.Module,
    keyed: Mapping[ParamKey, torch.Tensor],
    osd: Mapping[str, Any],
    form: SaveForm,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``osd`` (keyed as ``keyed`` keys the optimizer's parameters) keyed by names, as FSDP1's.

    Every rank must call it. Ranks may list their parameters in other orders (each rank's
    own optimizer): sharded state is converted in the model's parameter order, for the
    parameters the first rank's optimizer has state for (as FSDP1). Entries of no parameter
    of the optimizer (a state of the user's own) are kept as they are, with FSDP1's warning.
    Without ``param_groups`` in ``osd``, the result has none either.

    Raises:
        KeyError: a state entry's parameter is not one of the model's (on every rank, when
            one rank finds it).
        RuntimeError: a rank's optimizer has no state for a sharded parameter that the
            first rank's has (FSDP1's error); nothing is gathered.
    """
    names = names_by_param(model)
    order = {name: index for index, name in enumerate(names.values())}
    found: dict[str, Mapping[str, Any]] = {}
    own: dict[Any, Any] = {}
    unnamed: str | None = None
    for key, entry in osd["state"].items():
        if key not in keyed:
            warnings.warn(
                f"optimizer state entry {key!r} belongs to no parameter of the optimizer; it "
                "is copied to the result as it is (a state of the user's own?)",
                stacklevel=3,
            )
            own[key] = entry
        elif id(keyed[key]) not in names:
            unnamed = f"optimizer state entry {key!r}: its parameter is not one of the model's"
        else:
            found[names[id(keyed[key])]] = entry
    ordered = sorted(found, key=order.__getitem__)
    ordered = _agree_on_sharded(ordered, found, unnamed, group)
    # FSDP1 cuts a NO_SHARD unit's state only from its flat parameters: with
    # use_orig_params=True it hands out the optimizer's own whole tensors, SHARDED as FULL.
    no_shard = frozenset(
        id(unit.mesh)
        for unit in (unit_of(wrapper).unit for wrapper in units_in(model))
        if unit.strategy is ShardingStrategy.NO_SHARD and not unit.use_orig_params
    )
    state: dict[Any, Any] = {
        name: {k: _saved(v, form, no_shard) for k, v in found[name].items()} for name in ordered
    }
    if form.rank0_only and dist.get_rank(group) != 0:
        return {}
    result: dict[str, Any] = {"state": state | own}
    if "param_groups" in osd:
        result["param_groups"] = [
            {k: v for k, v in g.items() if k != "params"}
            | {"params": [_name_of(keyed, k, names) for k in g["params"]]}
            for g in osd["param_groups"]
        ]
    return result


def _name_of(keyed: Mapping[ParamKey, torch.Tensor], key: ParamKey, names: dict[int, str]) -> str:
    name = names.get(id(keyed[key]))
    if name is None:
        raise KeyError(f"optimizer state entry {key!r}: its parameter is not one of the model's")
    return name


def _agree_on_sharded(
    ordered: list[str],
    found: Mapping[str, Mapping[str, Any]],
    unnamed: str | None,
    group: dist.ProcessGroup | None,
) -> list[str]:
    """The names whose sharded state every rank converts: those of the group's first rank.

    Each sharded state tensor is gathered from every rank's shard with a collective, so the
    ranks must convert the same ones in the same order (the model's). As FSDP1 (flat
    parameters), the first rank's optimizer decides: a rank missing one of its entries
    raises on every rank, before any tensor moves; entries only other ranks hold are left
    out of the result.

    Raises:
        KeyError: ``unnamed`` (this rank's state entry of a parameter the model does not
            have) on some rank.
        RuntimeError: a rank has no state for a (name, state key) the first rank has.
    """
    mine = [
        (name, tuple(k for k, v in found[name].items() if is_sharded(v)))
        for name in ordered
        if any(is_sharded(v) for v in found[name].values())
    ]
    exchanged = gather_objects((unnamed, mine), group)
    both = cast(list[tuple[str | None, list[tuple[str, tuple[str, ...]]]]], exchanged)
    errors = [f"rank {rank}: {error}" for rank, (error, _) in enumerate(both) if error]
    if errors:
        raise KeyError("; ".join(errors))
    everyone = [theirs for _, theirs in both]
    reference = everyone[0]
    lines = []
    for rank, theirs in enumerate(everyone):
        missing = [entry for entry in reference if entry not in set(theirs)]
        if missing:
            said = ", ".join(f"{name} ({', '.join(keys)})" for name, keys in missing)
            lines.append(f"rank {rank} has no state for {said}")
    if lines:
        # FSDP1's words first: code written for it matches them.
        raise RuntimeError(
            "FSDP currently requires each rank to have at least the optimizer states needed "
            "by rank 0's optimizer but some ranks are missing some of those states (each "
            "state tensor is gathered from every rank's shard): " + "; ".join(lines)
        )
    agreed = {name for name, _ in reference}
    sharded = {name for name, _ in mine}
    return [name for name in ordered if name in agreed or name not in sharded]


def _loaded(value: Any, param: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, ShardedTensor | DTensor) and value.shape != param.shape:
        # A scalar (`step`): its own copy. FSDP1 gives every parameter of a flat parameter
        # the same step tensor, and optim.load_state_dict keeps it, so each step would
        # count once per parameter.
        return value.detach().clone()
    if not isinstance(param, DTensor):
        return value
    if isinstance(value, ShardedTensor) and is_chunked_whole(value, param):
        return placed_as(param, gather_chunks(value, param))
    if isinstance(value, ShardedTensor):
        local = local_of_loaded(value, param)
        return placed_as(param, local.to(param.to_local().device))
    if isinstance(value, DTensor):
        if not _gathers(value, param):
            return value
        value = value.full_tensor()
    if value.shape != param.shape:
        return value  # a state of its own shape
    full = value.to(param.to_local().device)
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def loadable(model: nn.Module, keyed: Mapping[ParamKey, torch.Tensor], osd: object) -> list[str]:
    """Check ``osd`` against the model and the optimizer as :func:`load_ready` reads it.

    Nothing moves: callers check on every rank, agree on the outcome and only then convert
    (converting runs collectives that a rank which failed would never enter).

    Returns:
        The ``name.state`` values :func:`load_ready` gathers with a collective, in its order:
        every rank of the model must have the same.

    Raises:
        TypeError: ``osd`` is not an optimizer state dict (``state``, a mapping of mappings;
            ``param_groups``, if there, a list of mappings each with a list of ``params``).
        KeyError: a parameter named in ``osd`` is the model's but not the optimizer's.
        ValueError: a sharded value does not have this rank's shard shape.
    """
    if not isinstance(osd, Mapping) or not isinstance(osd.get("state"), Mapping):
        raise TypeError(
            "an optimizer state dict is a mapping with a 'state' mapping, not a "
            f"{type(osd).__name__}"
            + (f" with keys {sorted(map(str, osd))}" if isinstance(osd, Mapping) else "")
        )
    order, key_of = _orders(model, keyed)
    gathered: list[str] = []
    for name in sorted(osd["state"], key=lambda n: (order.get(n, len(order)), str(n))):
        entry = osd["state"][name]
        if not isinstance(entry, Mapping):
            raise TypeError(
                f"optimizer state for {name!r}: a {type(entry).__name__}, not a mapping"
            )
        if name not in order:
            continue
        param = keyed[_key_for(name, key_of)]
        for key, value in entry.items():
            chunked = isinstance(value, ShardedTensor) and is_chunked_whole(value, param)
            if chunked and isinstance(param, DTensor):
                check_chunk(value, param, f"optimizer state {name!r} {key!r}")
                gathered.append(f"{name}.{key}")
            elif _gathers(value, param):
                gathered.append(f"{name}.{key}")
            elif isinstance(value, ShardedTensor) and isinstance(param, DTensor):
                local, mine = local_of_loaded(value, param).shape, param.to_local().shape
                if local != mine:
                    raise ValueError(
                        f"optimizer state {name!r} {key!r}: this rank's shard is "
                        f"{tuple(local)}, the parameter's is {tuple(mine)}"
                    )
    groups = osd.get("param_groups", [])
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        raise TypeError(
            "an optimizer state dict's 'param_groups' is a list of mappings, each "
            "with a list of 'params'"
        )
    for group in groups:
        for name in group["params"]:
            _key_for(name, key_of)
    return gathered


def _gathers(value: object, param: torch.Tensor) -> bool:
    """Whether :func:`_loaded` gathers ``value`` (a DTensor laid out unlike ``param``)."""
    return (
        isinstance(value, DTensor)
        and isinstance(param, DTensor)
        and (value.device_mesh != param.device_mesh or value.placements != param.placements)
    )


def _orders(
    model: nn.Module, keyed: Mapping[ParamKey, torch.Tensor]
) -> tuple[dict[str, int], dict[str, ParamKey]]:
    """Each model parameter name's position, and the optimizer's key of each it holds."""
    names = names_by_param(model)
    order = {name: index for index, name in enumerate(names.values())}
    key_of: dict[str, ParamKey] = {}
    for key, param in keyed.items():
        if id(param) in names:
            key_of.setdefault(names[id(param)], key)
    return order, key_of


def load_ready(
    model: nn.Module, keyed: Mapping[ParamKey, torch.Tensor], osd: Mapping[str, Any]
) -> dict[str, Any]:
    """Name-keyed ``osd`` (full or sharded) as ``optim.load_state_dict`` takes it, as FSDP1's.

    ``keyed``: the optimizer's parameters by the keys it uses (positions, or a named
    optimizer's names). Each param group of ``osd`` lists its parameters' keys, sorted; the
    optimizer pairs them with its own groups in order. A parameter of the optimizer that
    ``osd`` does not name is in no group (FSDP1 leaves its key out too, for the caller to add
    with its state); an entry of no model parameter (a state of the user's own) is kept as
    it is. Without ``param_groups`` in ``osd``, the result has none either. Collective where
    a value is laid out unlike its parameter: check with :func:`loadable` first.

    Raises:
        KeyError: a parameter named in ``osd`` is the model's but not the optimizer's.
    """
    order, key_of = _orders(model, keyed)
    state: dict[Any, Any] = {}
    for name in sorted(osd["state"], key=lambda n: (order.get(n, len(order)), str(n))):
        entry = osd["state"][name]
        if name not in order:
            state[name] = copy.copy(entry)
            continue
        key = _key_for(name, key_of)
        state[key] = {k: _loaded(v, keyed[key]) for k, v in entry.items()}
    result: dict[str, Any] = {"state": state}
    if "param_groups" in osd:
        groups = copy.deepcopy(list(osd["param_groups"]))
        for group in groups:
            group["params"] = sorted(_key_for(name, key_of) for name in group["params"])
        result["param_groups"] = groups
    return result


def _key_for(name: str, key_of: Mapping[str, ParamKey]) -> ParamKey:
    if name not in key_of:
        raise KeyError(
            f"optimizer state for {name!r}: no such parameter in the optimizer (its "
            f"parameters are {sorted(key_of)[:5]}...)"
        )
    return key_of[name]


def receive_from_first(
    osd: Mapping[str, Any] | None, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """The first rank's full, name-keyed ``osd`` on every rank, one tensor at a time.

    Every rank must call it; only the first rank's ``osd`` is read.

    Raises:
        ValueError: on every rank alike, before any tensor moves: the first rank's ``osd``
            is missing or not an optimizer state dict.
    """
    first = dist.get_rank(group) == 0
    error: Exception | None = None
    skeleton: dict[str, Any] | None = None
    if first:
        try:
            skeleton = _skeleton(osd)
        except (TypeError, ValueError) as problem:
            error = problem
    # Only the first rank can tell whether its dict is one: it says so with the skeleton.
    said = broadcast_object((None, skeleton) if error is None else (str(error), None), group)
    message, skeleton = cast(tuple[str | None, dict[str, Any] | None], said)
    if message is not None or skeleton is None:
        raise ValueError(f"the first rank's full optimizer state dict: {message}") from error
    state: dict[str, Any] = {}
    for name in sorted(skeleton["state"]):
        entry: dict[str, Any] = {}
        for key, value in skeleton["state"][name].items():
            if isinstance(value, _TensorSpec):
                tensor = (
                    osd["state"][name][key].detach().clone()
                    if first and osd is not None
                    else torch.empty(value.shape, dtype=value.dtype)
                )
                broadcast(tensor, group)
                value = tensor
            entry[key] = value
        state[name] = entry
    received: dict[str, Any] = {"state": state}
    if "param_groups" in skeleton:
        received["param_groups"] = skeleton["param_groups"]
    return received


@dataclass(frozen=True, slots=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _skeleton(osd: object) -> dict[str, Any]:
    """``osd`` with each tensor replaced by its shape and dtype.

    Raises:
        ValueError: ``osd`` is missing.
        TypeError: ``osd`` is not a mapping with a ``state`` mapping of mappings.
    """
    if osd is None:
        raise ValueError("it is None (the first rank must pass it)")
    if not isinstance(osd, Mapping) or not isinstance(osd.get("state"), Mapping):
        raise TypeError(f"a {type(osd).__name__}, not a mapping with a 'state' mapping")
    state: dict[Any, Any] = {}
    for name, entry in osd["state"].items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"state for {name!r}: a {type(entry).__name__}, not a mapping")
        state[name] = {
            k: _TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
            for k, v in entry.items()
        }
    skeleton: dict[str, Any] = {"state": state}
    if "param_groups" in osd:
        skeleton["param_groups"] = osd["param_groups"]
    return skeleton
