"""Optimizer state of flat parameters, as the per-parameter state FSDP1's APIs save and load.

An optimizer built on ``use_orig_params=False`` wrappers holds one flat parameter per unit,
and one state tensor of its shape per state key. FSDP1's optimizer-state APIs save state per
original parameter; so before the per-parameter conversion (:mod:`shardkit.legacy.
optim_state`) each flat entry becomes one entry per original, each tensor a DTensor around
that original's slot of the flat tensor (no copy), and after a load each original's state is
written back into its slot of one flat tensor. Scalars (``step``) are the unit's, shared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardkit.legacy.flat_params import FlatParam, flat_of
from shardkit.legacy.optim_keys import ParamKey

__all__ = ["PerParameter", "per_parameter"]


@dataclass(frozen=True, slots=True)
class PerParameter:
    """An optimizer's parameters with each flat one replaced by its originals."""

    keyed: dict[ParamKey, torch.Tensor]
    """The parameters by new positions (or the optimizer's own keys when nothing is flat)."""
    new_keys: dict[ParamKey, list[ParamKey]]
    """The optimizer's key of each parameter -> its new positions."""
    flats: dict[ParamKey, FlatParam]
    """The optimizer's keys that are flat parameters."""

    def expand(self, osd: Mapping[str, Any]) -> dict[str, Any]:
        """``osd`` (keyed by the optimizer's keys) keyed per original parameter."""
        if not self.flats:
            return dict(osd)
        state: dict[Any, Any] = {}
        for key, entry in osd["state"].items():
            flat = self.flats.get(key)
            if key not in self.new_keys:
                state[key] = entry  # a state of the user's own
            elif flat is None:
                state[self.new_keys[key][0]] = entry
            else:
                views = {k: _views(flat, v) for k, v in entry.items()}
                for index, new in enumerate(self.new_keys[key]):
                    state[new] = {
                        k: v if u is None else u[index]
                        for (k, v), u in zip(entry.items(), views.values(), strict=True)
                    }
        result: dict[str, Any] = {"state": state}
        if "param_groups" in osd:
            result["param_groups"] = [
                dict(g, params=[n for k in g["params"] for n in self.new_keys[k]])
                for g in osd["param_groups"]
            ]
        return result

    def collapse(self, osd: Mapping[str, Any]) -> dict[str, Any]:
        """Per-parameter ``osd`` (new positions) keyed by the optimizer's keys again."""
        if not self.flats:
            return dict(osd)
        old_of = {new: old for old, news in self.new_keys.items() for new in news}
        # In ``osd``'s order (the model's, on every rank), not the optimizer's: callers
        # convert tensors with collectives in this order.
        state: dict[Any, Any] = {}
        for key, entry in osd["state"].items():
            old = old_of.get(key)
            if old is None:
                state[key] = entry  # a state of the user's own
            elif old not in state:
                flat = self.flats.get(old)
                news = self.new_keys[old]
                state[old] = (
                    entry if flat is None else _flattened(flat, [osd["state"].get(n) for n in news])
                )
        result: dict[str, Any] = {"state": state}
        if "param_groups" in osd:
            groups = []
            for g in osd["param_groups"]:
                olds = list(dict.fromkeys(old_of[n] for n in g["params"]))
                groups.append(dict(g, params=olds))
            result["param_groups"] = groups
        return result


def per_parameter(keyed: Mapping[ParamKey, torch.Tensor]) -> PerParameter:
    """``keyed`` with each flat parameter replaced by its originals, at new positions.

    Raises:
        ValueError: an optimizer keyed by names (a named optimizer) holds flat parameters.
    """
    flats = {k: f for k, t in keyed.items() if (f := flat_of(t)) is not None}
    if not flats:
        return PerParameter(dict(keyed), {k: [k] for k in keyed}, {})
    if any(isinstance(k, str) for k in keyed):
        raise ValueError(
            "an optimizer that keys its state by parameter names holds flat parameters "
            "(use_orig_params=False); its state cannot be converted: use use_orig_params=True"
        )
    new_keyed: dict[ParamKey, torch.Tensor] = {}
    new_keys: dict[ParamKey, list[ParamKey]] = {}
    for key, tensor in keyed.items():
        flat = flats.get(key)
        members = [tensor] if flat is None else list(flat.originals)
        new_keys[key] = []
        for member in members:
            new_keys[key].append(len(new_keyed))
            new_keyed[len(new_keyed)] = member
    return PerParameter(new_keyed, new_keys, flats)


def _views(flat: FlatParam, value: Any) -> tuple[DTensor, ...] | None:
    """Each original's slot of a flat state tensor as a DTensor like it (None: a scalar)."""
    if not isinstance(value, torch.Tensor) or value.shape != flat.param.shape:
        return None
    return tuple(flat.as_param(v, i) for i, v in enumerate(flat.views(value)))


def _flattened(flat: FlatParam, entries: list[Mapping[str, Any] | None]) -> dict[str, Any]:
    """One flat state entry from each original's (None: no state, zeros in its slot).

    Raises:
        ValueError: a scalar state (``step``) is missing for some originals or differs
            between them, as FSDP1 raises: one flat tensor has one scalar.
    """
    merged: dict[str, Any] = {}
    scalars: dict[str, list[Any]] = {}
    for index, entry in enumerate(entries):
        if entry is None:
            continue
        for k, v in entry.items():
            if isinstance(v, DTensor) and v.shape == flat.originals[index].shape:
                if k not in merged:
                    merged[k] = torch.zeros_like(flat.param, dtype=v.dtype)
                flat.views(merged[k])[index].copy_(v.to_local())
            else:
                if not (isinstance(v, torch.Tensor) and v.dim() > 0):
                    scalars.setdefault(k, []).append(v)
                merged.setdefault(k, v)
    names = [p.keys[0] for p in flat.group.params]
    for k, values in scalars.items():
        _check_one_scalar(names, k, values, len(entries))
    return merged


def _check_one_scalar(names: list[str], key: str, values: list[Any], members: int) -> None:
    """Refuse a scalar state that the originals of one flat parameter do not share."""
    if all(v is None for v in values):
        return  # FSDP1 keeps a state that is None for every original
    seen = {(v.item(), v.dtype) if isinstance(v, torch.Tensor) else (v, None) for v in values}
    if len(values) != members or len(seen) != 1:
        raise ValueError(
            "All unflattened parameters comprising a single flat parameter must have "
            f"scalar state with the same value and dtype, but state {key!r} is "
            f"{sorted(map(str, seen))} on {len(values)} of the {members} parameters of the "
            f"flat parameter of ({', '.join(names)}): a loaded optimizer state misses some "
            "of them"
        )
