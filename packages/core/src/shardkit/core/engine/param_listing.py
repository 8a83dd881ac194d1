"""Where a managed parameter is registered: listed in ``module._parameters``, or not.

By default the engine registers each parameter (sharded or unsharded) as ``nn.Module`` does,
so ``parameters()`` and ``state_dict()`` list it, as torch's ``fully_shard`` does. An adapter
that shows its own parameters in their place (FSDP1's flat parameters, one per unit) asks a
group to hold them *unlisted*: as plain attributes in the module's ``__dict__``, which
attribute lookup finds first, so ``module.weight`` in a forward still reads the parameter the
engine put there, while ``parameters()``, ``state_dict()`` and ``module.to()`` walk past it.
Listing them again puts each back at its place in ``_parameters``, so names keep their order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn

__all__ = [
    "Listable",
    "ParamSlot",
    "list_slots",
    "read_slot",
    "set_listed",
    "unlist_slots",
    "write_slot",
]


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """One place a parameter is registered: ``_parameters[name]``, or unlisted ``__dict__``."""

    module: nn.Module
    name: str


class Listable(Protocol):
    """A managed parameter: where it is registered, and whether it is listed now."""

    listed: bool

    @property
    def slots(self) -> Sequence[ParamSlot]:
        """Every place it is registered (a tied parameter has several)."""


def set_listed(params: Sequence[Listable], listed: bool, order: dict[int, list[str]]) -> None:
    """List (True) or unlist (False) all of ``params`` (one group's); a no-op if they are.

    ``order`` is the group's own, kept between the two calls (see :func:`unlist_slots`).
    """
    if all(p.listed == listed for p in params):
        return
    slots = [slot for p in params for slot in p.slots]
    if listed:
        list_slots(slots, order)
    else:
        unlist_slots(slots, order)
    for p in params:
        p.listed = listed


def read_slot(slot: ParamSlot) -> nn.Parameter | None:
    """What ``slot`` holds now, listed or not."""
    held = slot.module.__dict__.get(slot.name)
    if held is not None:
        return held  # type: ignore[no-any-return]  # only the engine puts tensors here
    return slot.module._parameters.get(slot.name)


def write_slot(slot: ParamSlot, param: nn.Parameter, listed: bool) -> None:
    """Register ``param`` at ``slot``: listed in ``_parameters`` or as a plain attribute.

    Bypasses ``nn.Module.__setattr__``: it is slow, and the engine only swaps like for like.
    """
    if listed:
        slot.module._parameters[slot.name] = param
    else:
        slot.module.__dict__[slot.name] = param


def unlist_slots(slots: Iterable[ParamSlot], order: dict[int, list[str]]) -> None:
    """Move each slot's parameter out of ``_parameters`` into the module's ``__dict__``.

    ``order`` gets each module's ``_parameters`` names as they were (by ``id`` of the module),
    for :func:`list_slots` to put them back where they were.
    """
    for slot in slots:
        params = slot.module._parameters
        order.setdefault(id(slot.module), list(params))
        if slot.name in params:
            slot.module.__dict__[slot.name] = params.pop(slot.name)


def list_slots(slots: Iterable[ParamSlot], order: dict[int, list[str]]) -> None:
    """Undo :func:`unlist_slots`: each parameter back in ``_parameters``, in the old order."""
    by_module: dict[int, tuple[nn.Module, set[str]]] = {}
    for slot in slots:
        by_module.setdefault(id(slot.module), (slot.module, set()))[1].add(slot.name)
    for key, (module, names) in by_module.items():
        params = module._parameters
        back = {n: module.__dict__.pop(n) for n in names if n in module.__dict__}
        current = dict(params)
        params.clear()
        for name in order.pop(key, []):
            if name in back:
                params[name] = back.pop(name)
            elif name in current:
                params[name] = current.pop(name)
        params.update(back)
        params.update(current)  # registered since (none the engine made)
