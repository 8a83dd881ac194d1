"""A whole-matrix optimizer's state dict, checked before any of it loads.

``torch.optim.Optimizer.load_state_dict`` takes what it is given: a momentum of another shape
loads and fails at the next step on the owner only (the other ranks then wait in the
exchange); one of another dtype is cast without a word; a DTensor on another mesh or
placement, a plain full tensor where the parameter is sharded, state for a parameter index no
group has, AdamW's ``exp_avg`` in Muon's state, a NaN that no later step can wash out of a
momentum: each loads and trains something else. So every rank checks the state dict here
first, the ranks share what they found (``runtime.p2p.agreement``: a bad row block may sit on
one rank only), and every rank raises the same error, naming the parameter and the key,
before anything is loaded.

The optimizer keeps no owner in its state: owners are a pure function of the matrices' costs
and the world (``owners.py``), recomputed after a load. What a state dict can claim is a
layout, the momentum's mesh, placements and row blocks; one that is not the parameter's is
refused here. Hyperparameters may differ from the optimizer's (a resumed learning-rate
schedule), but the saved group must have every one the optimizer has and pass the checks it
applies to a group it is given. A parameter with no state (it never had a gradient) is
fine, as in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from shardkit.core.optim.rule import Options, WholeMatrixRule
from shardkit.core.runtime.dtensors import local_of
from shardkit.core.runtime.p2p.agreement import everyone, raise_shared

__all__ = [
    "Loadable",
    "check_loadable",
    "check_saved_group",
    "check_state_dict",
    "check_state_value",
    "named_params",
    "saved_parts",
]

_PARAMS, _NAMES = "params", "param_names"


class Loadable(Protocol):
    """What the checks read of a whole-matrix optimizer (``WholeMatrixOptimizer`` is one)."""

    param_groups: list[dict[str, Any]]
    rule: WholeMatrixRule

    def check_options(self, options: Options) -> None:
        """Raise ValueError for hyperparameters the optimizer cannot step with."""


def check_loadable(optimizer: Loadable, state_dict: Any) -> None:
    """Raise unless ``state_dict`` can be ``optimizer``'s state; the same error on every rank.

    Collective over the world where any parameter is a DTensor (every rank loads its
    optimizer then); local otherwise.

    Raises:
        TypeError: a state dict, a group or a parameter's state that is not a mapping, or a
            state value that is not a tensor.
        ValueError: anything else that does not match (see the module's docstring), naming
            the parameter and the key, prefixed with the rank that found it where shared.
    """
    sharded = any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g[_PARAMS])
    if not sharded:
        check_state_dict(optimizer, state_dict)
        return
    raise_shared(everyone(lambda: check_state_dict(optimizer, state_dict)))


def check_state_dict(optimizer: Loadable, state_dict: Any) -> None:
    """:func:`check_loadable` on this rank alone: the caller shares what it finds.

    Raises:
        TypeError, ValueError: as :func:`check_loadable`, unshared.
    """
    name = optimizer.rule.name
    saved_groups, state = saved_parts(name, state_dict, len(optimizer.param_groups))
    by_index: dict[Any, tuple[str, torch.Tensor]] = {}
    for index, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        named = named_params(group, index)
        check_saved_group(name, optimizer.check_options, saved, group, named, index)
        by_index.update(zip(saved[_PARAMS], named, strict=True))
    keys = frozenset(optimizer.rule.init_state(torch.empty(1, 1, device="meta")))
    for index, entry in state.items():
        if index not in by_index:
            raise ValueError(
                f"{name}: the state dict has state for parameter {index!r}, which none of its "
                "parameter groups lists"
            )
        _check_entry(name, by_index[index], entry, keys)


def saved_parts(
    optimizer_name: str, state_dict: Any, groups: int
) -> tuple[list[Any], Mapping[Any, Any]]:
    """``state_dict``'s saved groups and state, once it has their types and ``groups`` groups.

    Raises:
        TypeError: not a state dict, or 'param_groups' not a list, 'state' not a mapping.
        ValueError: another number of groups.
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise TypeError(
            f"{optimizer_name}: a state dict has 'state' and 'param_groups', this one does not"
        )
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, list) or not isinstance(state, Mapping):
        raise TypeError(f"{optimizer_name}: 'param_groups' must be a list and 'state' a mapping")
    if len(saved_groups) != groups:
        raise ValueError(
            f"{optimizer_name}: the state dict has {len(saved_groups)} parameter groups, this "
            f"optimizer has {groups}"
        )
    return saved_groups, state


def check_saved_group(
    optimizer_name: str,
    check_options: Callable[[Options], None],
    saved: Any,
    group: dict[str, Any],
    named: list[tuple[str, torch.Tensor]],
    index: int,
) -> None:
    """Refuse a saved group unlike ``group``, the ``index``-th of optimizer ``optimizer_name``.

    Its parameters must be the same (by count, and by name where both have names), with every
    hyperparameter the optimizer's group has, at values ``check_options`` accepts.

    Raises:
        TypeError, ValueError: naming the group and its first parameter.
    """
    where = f"{optimizer_name}: parameter group {index} (first parameter {named[0][0]})"
    if not isinstance(saved, Mapping) or not isinstance(saved.get(_PARAMS), list):
        raise TypeError(f"{where}: the saved group is not a mapping with a 'params' list")
    if len(saved[_PARAMS]) != len(named):
        raise ValueError(
            f"{where}: the saved group has {len(saved[_PARAMS])} parameters, this one {len(named)}"
        )
    saved_names = saved.get(_NAMES)
    if saved_names and group.get(_NAMES) and list(saved_names) != list(group[_NAMES]):
        theirs, ours = next(
            (s, o) for s, o in zip(saved_names, group[_NAMES], strict=True) if s != o
        )
        raise ValueError(f"{where}: the saved state of {theirs!r} would load into {ours!r}")
    # Extra names are kept, as torch keeps them (a scheduler's ``initial_lr``, torch's Muon's
    # flags); a missing one is another optimizer's group, which the step would fail on.
    missing = sorted(set(group) - set(saved) - {_PARAMS, _NAMES})
    if missing:
        raise ValueError(
            f"{where}: the saved group has no {missing}: the state of another optimizer?"
        )
    try:
        check_options(saved)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: a saved hyperparameter is refused: {error}") from None


def _check_entry(
    optimizer_name: str, named: tuple[str, torch.Tensor], entry: Any, keys: frozenset[str]
) -> None:
    """Refuse one parameter's saved state unless it is the rule's keys, each a fit tensor.

    Fit: the parameter's shape, dtype and layout, and finite.
    """
    name, param = named
    where = f"{optimizer_name}: {name}"
    if not isinstance(entry, Mapping):
        raise TypeError(f"{where}: its state is a {type(entry).__name__}, not a mapping")
    if set(entry) != keys:
        extra, missing = sorted(set(entry) - keys), sorted(keys - set(entry))
        raise ValueError(
            f"{where}: its state has keys {sorted(entry)}, {optimizer_name} keeps {sorted(keys)} "
            f"(extra {extra}, missing {missing})"
        )
    for key, value in entry.items():
        check_state_value(f"{where}: state {key!r}", param, value)


def check_state_value(where: str, param: torch.Tensor, value: Any) -> None:
    """Refuse a state tensor unfit for ``param``: another shape, dtype or layout, not finite.

    Raises:
        TypeError: not a tensor.
        ValueError: the rest, prefixed with ``where``.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} is a {type(value).__name__}, not a tensor")
    if value.shape != param.shape:
        raise ValueError(
            f"{where} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
        )
    if value.dtype != param.dtype:
        # torch would cast it in silence; a resumed run must not start from other bits.
        raise ValueError(
            f"{where} is {value.dtype}, the parameter {param.dtype} (cast the checkpoint's "
            "state explicitly if that is meant)"
        )
    if isinstance(param, DTensor) != isinstance(value, DTensor):
        kinds = {True: "sharded (a DTensor)", False: "a plain tensor"}
        raise ValueError(
            f"{where} is {kinds[isinstance(value, DTensor)]}, the parameter is "
            f"{kinds[isinstance(param, DTensor)]}: load sharded state through "
            "torch.distributed.checkpoint (get_state_dict / set_state_dict), which reshards it"
        )
    if isinstance(param, DTensor) and isinstance(value, DTensor):
        _check_layout(where, param, value)
    rows = local_of(value) if isinstance(value, DTensor) else value
    if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
        raise ValueError(f"{where} holds NaN or infinite values: no later step can remove them")


def _check_layout(where: str, param: DTensor, value: DTensor) -> None:
    """The state's layout is the parameter's: the same mesh, placements and row block here."""
    if value.device_mesh != param.device_mesh or tuple(value.placements) != tuple(param.placements):
        raise ValueError(
            f"{where} is laid out as {tuple(value.placements)} on mesh "
            f"{tuple(value.device_mesh.shape)}, the parameter as {tuple(param.placements)} on "
            f"{tuple(param.device_mesh.shape)}: state saved for another layout (load it "
            "through torch.distributed.checkpoint to reshard it)"
        )
    mine, theirs = local_of(value).shape, local_of(param).shape
    if mine != theirs:
        raise ValueError(
            f"{where}: this rank's block is {tuple(mine)}, the parameter's {tuple(theirs)}"
        )


def named_params(group: Mapping[str, Any], index: int) -> list[tuple[str, torch.Tensor]]:
    """Each parameter of ``group`` with the name errors give it (as the optimizer's steps do)."""
    params: list[torch.Tensor] = group[_PARAMS]
    names: list[str] | None = group.get(_NAMES)
    return [
        (names[j] if names else f"param_groups[{index}]['params'][{j}]", p)
        for j, p in enumerate(params)
    ]
