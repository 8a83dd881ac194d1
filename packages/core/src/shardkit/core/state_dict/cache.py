"""torch's ``get_state_dict(model, optimizer)`` for a loop that takes it every step, cheaply.

``torch.distributed.checkpoint.state_dict.get_state_dict`` turns the module's and the
optimizer's own state dicts into DCP's form: every key a canonical FQN (wrappers' prefixes
removed), the optimizer's parameter indices replaced by those FQNs. Finding the FQNs walks the
module tree once per parameter, every call: about 5 ms for a 100-parameter model, more than
the rest of a memory snapshot (``memory_snapshots.py``) together. The names do not change from step
to step, so ``StateDictCache`` learns them once from torch's own answer and then asks only the
module and the optimizer for their state dicts (their hooks run as always) and renames.

Nothing is assumed: the first call (and any call after the model or the optimizer changed
shape) computes torch's answer and keeps the renaming only if, applied to the raw state
dicts, it gives that answer back exactly (the same keys in the same order, tensors sharing
their storage, every other value equal). Otherwise every call is torch's own.
See [Note: memory snapshots].
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["StateDictCache"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Renaming:
    """What turns the module's and the optimizer's raw state dicts into torch's form."""

    model_keys: tuple[tuple[str, str], ...]  # (raw key, FQN), in the state dict's order
    param_fqns: dict[int, str]  # the optimizer's parameter index -> FQN
    params: tuple[int, ...]  # ids of the optimizer's parameters, group by group (the check)


class StateDictCache:
    """``get_state_dict(model, optimizer)``, with the FQNs learned once.

    Call it where you would call ``get_state_dict(model, optimizer)`` (for example in a
    ``Stateful``'s ``state_dict``, which ``MemorySnapshots`` asks every step): it returns the
    same two dicts. A model whose state dict keys change, or an optimizer whose parameters
    change, is learned again on the next call.

    Args:
        model: the module (sharded or not).
        optimizer: its optimizer.
        keep_vars: the model's parameters themselves rather than detached aliases of them,
            as ``Module.state_dict(keep_vars=True)`` gives (the same storage either way).
            For a reader that only copies the values out, such as ``MemorySnapshots``: a
            DTensor's ``detach`` is a dispatch of its own, about 1 ms a call for 150
            parameters. A writer into them must do so under ``torch.no_grad()``.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, keep_vars: bool = False
    ) -> None:
        self.model, self.optimizer, self.keep_vars = model, optimizer, keep_vars
        self._renaming: _Renaming | None = None
        self._uncacheable_params: tuple[int, ...] | None = None

    def __call__(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state dicts, as ``get_state_dict`` returns them."""
        params = _param_ids(self.optimizer)
        renaming = self._renaming
        if renaming is not None and renaming.params == params:
            raw_model = self.model.state_dict(keep_vars=self.keep_vars)
            renamed = _rename(renaming, raw_model, self.optimizer.state_dict())
            if renamed is not None:
                return renamed
        if self._uncacheable_params == params:
            return get_state_dict(self.model, self.optimizer)
        return self._learn(params)

    def _learn(self, params: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Torch's answer, and the renaming that reproduces it (if one does)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        raw_model = self.model.state_dict(keep_vars=self.keep_vars)
        raw_optim = self.optimizer.state_dict()
        renaming = _renaming_of(raw_model, raw_optim, model_sd, optim_sd, params)
        renamed = None if renaming is None else _rename(renaming, raw_model, raw_optim)
        if renamed is not None:
            self._renaming, self._uncacheable_params = renaming, None
            if self.keep_vars:
                return renamed  # torch's answer, with the parameters themselves
        else:
            logger.info("StateDictCache: the FQNs could not be learned; using get_state_dict")
            self._renaming, self._uncacheable_params = None, params
        return model_sd, optim_sd


def _param_ids(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(id(p) for group in optimizer.param_groups for p in group["params"])


def _renaming_of(
    raw_model: Mapping[str, Any],
    raw_optim: Mapping[str, Any],
    model_sd: Mapping[str, Any],
    optim_sd: Mapping[str, Any],
    params: tuple[int, ...],
) -> _Renaming | None:
    """The renaming that turns the raw state dicts into torch's, checked item by item."""
    if len(raw_model) != len(model_sd):
        return None
    model_keys = tuple(zip(raw_model, model_sd, strict=True))
    if not all(_same(raw_model[raw], model_sd[fqn]) for raw, fqn in model_keys):
        return None
    raw_groups, groups = raw_optim.get("param_groups"), optim_sd.get("param_groups")
    if not isinstance(raw_groups, list) or not isinstance(groups, list):
        return None
    if len(raw_groups) != len(groups):
        return None
    param_fqns: dict[int, str] = {}
    for raw_group, group in zip(raw_groups, groups, strict=True):
        indices, fqns = raw_group.get("params"), group.get("params")
        if not isinstance(indices, list) or not isinstance(fqns, list):
            return None
        if len(indices) != len(fqns):
            return None
        param_fqns.update(zip(indices, fqns, strict=True))
    if len(param_fqns) != len(params) or len(set(param_fqns.values())) != len(params):
        return None  # a parameter under two FQNs, or two under one: not a renaming
    renaming = _Renaming(model_keys, param_fqns, params)
    expected = _rename_optim(renaming, raw_optim)
    return renaming if expected is not None and _same(expected, optim_sd) else None


def _rename(
    renaming: _Renaming, raw_model: Mapping[str, Any], raw_optim: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The raw state dicts in torch's form, or None if their keys are not those learned."""
    if len(raw_model) != len(renaming.model_keys):
        return None
    model_sd: dict[str, Any] = {}
    for (raw, fqn), key in zip(renaming.model_keys, raw_model, strict=True):
        if raw != key:
            return None
        model_sd[fqn] = raw_model[key]
    optim_sd = _rename_optim(renaming, raw_optim)
    return None if optim_sd is None else (model_sd, optim_sd)


def _rename_optim(renaming: _Renaming, raw_optim: Mapping[str, Any]) -> dict[str, Any] | None:
    fqns = renaming.param_fqns
    state = raw_optim.get("state", {})
    if not all(index in fqns for index in state):
        return None
    groups = []
    for group in raw_optim.get("param_groups", []):
        renamed = dict(group)
        renamed["params"] = [fqns[index] for index in group["params"]]
        groups.append(renamed)
    return {"state": {fqns[index]: value for index, value in state.items()}, "param_groups": groups}


def _same(a: Any, b: Any) -> bool:
    """Equal values: tensors sharing their storage and layout, containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and bool(a == b)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    if isinstance(a, DTensor) and isinstance(b, DTensor):
        if a.placements != b.placements or a.device_mesh != b.device_mesh:
            return False
        a, b = a.to_local(), b.to_local()
    return a is b or (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
        and a.device == b.device
    )
