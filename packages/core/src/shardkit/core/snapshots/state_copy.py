"""A state's tensors copied into a snapshot's bytes, and a snapshot written back into a state.

The training thread copies the state at every snapshot, so the copy is made cheap: one
concatenation of the sources' bytes where they are contiguous host tensors (``SlotCopier``),
one foreach copy otherwise (``copy_to_views``), after a check that the state still has the
first snapshot's layout (``fits``; ``FitCheck`` in a few list comparisons). A restore writes
the snapshot back in place, as DCP loads a checkpoint (``restore_into``). What a snapshot holds
and where each tensor's bytes are: ``contents``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from shardkit.core.snapshots.contents import (
    DATA_ALIGN,
    JSONValue,
    Layout,
    Leaves,
    TensorEntry,
    dtype_named,
)

__all__ = ["FitCheck", "SlotCopier", "copy_to_views", "fits", "restore_into"]


@functools.cache
def _dtype_of(name: str) -> torch.dtype:
    """``dtype_named``, remembered: a snapshot every step compares hundreds of dtypes."""
    return dtype_named(name)


def copy_to_views(views: list[torch.Tensor], layout: Layout, leaves: Leaves) -> None:
    """Copy every tensor of ``leaves`` into ``views``, its places in a slot (layout order).

    One foreach copy: hundreds of small tensors (a model's parameters, and each one's
    optimizer state) cost one call, not one each.
    """
    sources = [leaves.tensors[entry.key] for entry in layout.entries]
    with torch.no_grad():
        if all(source.device.type == "cpu" for source in sources):
            torch._foreach_copy_(views, sources)
        else:  # an accelerator's tensors: each copy_ moves its bytes to the host itself
            for view, source in zip(views, sources, strict=True):
                view.copy_(source)


class SlotCopier:
    """Copies a state's tensors into a slot's data bytes in one call: a concatenation.

    A per-tensor copy, even a foreach one, pays a few microseconds a tensor, which for the
    hundreds of a state (each parameter and each one's optimizer state) is most of the copy:
    1.5 ms for the demo's 405 tensors (7.4 MB) against 0.5 ms for one ``torch.cat`` of their
    bytes into the slot, the 64-byte gaps between them written as the zeros they are.

    Each source's byte view is made once and kept while the source starts where its view does,
    contiguous, checked every time; one that moved (an RNG state is a new tensor every call;
    an optimizer's ``load_state_dict``, a re-pointed DTensor or a ``set_`` moves others) gets
    a new view. Not the same tensor objects: a module's ``state_dict()`` gives new ones every
    call (``detach()``) over the same memory. The address suffices: the kept view holds its
    memory alive, so no other allocation can start there, and the same start, shape
    (``fits``), dtype and contiguity are the same bytes. Where a source is not a contiguous
    host tensor (an accelerator's), it copies tensor by tensor.
    """

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        gap = torch.zeros(DATA_ALIGN, dtype=torch.uint8)
        self._pieces: list[torch.Tensor] = []  # the sources' bytes, with the gaps between
        self._places: list[int] = []  # each entry's piece
        end = 0
        for entry in layout.entries:
            if entry.offset > end:
                self._pieces.append(gap[: entry.offset - end])
            self._places.append(len(self._pieces))
            self._pieces.append(gap[:0])  # a view that no source matches: made at first copy
            end = entry.offset + entry.nbytes
        if layout.data_bytes > end:
            self._pieces.append(gap[: layout.data_bytes - end])

    def copy(self, data: torch.Tensor, views: list[torch.Tensor], leaves: Leaves) -> None:
        """Copy ``leaves``' tensors into ``data`` (a slot's bytes); ``views``: their places in it.

        The caller checked ``fits(layout, leaves)``.
        """
        sources = [leaves.tensors[entry.key] for entry in self._layout.entries]
        with torch.no_grad():
            if self._follow(sources):
                torch.cat(self._pieces, out=data)
            else:
                copy_to_views(views, self._layout, leaves)

    def _follow(self, sources: list[torch.Tensor]) -> bool:
        """Point the byte views at ``sources``; False if one is not a contiguous host tensor."""
        pieces = self._pieces
        # The view's address, not one remembered: a storage resized in place moves its views.
        moved = [
            k
            for k, (source, place) in enumerate(zip(sources, self._places, strict=True))
            if source.data_ptr() != pieces[place].data_ptr() or not source.is_contiguous()
        ]
        for k in moved:
            source = sources[k]
            if source.device.type != "cpu" or not source.is_contiguous():
                return False
            pieces[self._places[k]] = source.detach().reshape(-1).view(torch.uint8)
        return True


def fits(layout: Layout, leaves: Leaves) -> bool:
    """Whether ``leaves`` have ``layout`` (keys, dtypes, shapes): ``Layout.of`` without its cost.

    A snapshot every step compares the state with the first snapshot's layout each time; this
    compares in place instead of building a new layout of hundreds of entries.
    """
    tensors, shapes = leaves.tensors, leaves.global_shapes
    if len(tensors) != len(layout.entries) or tuple(sorted(leaves.values)) != layout.value_keys:
        return False
    for entry in layout.entries:
        tensor = tensors.get(entry.key)
        if (
            tensor is None
            or tensor.shape != entry.shape
            or shapes[entry.key] != entry.global_shape
            or tensor.dtype != _dtype_of(entry.dtype)
        ):
            return False
    return True


class FitCheck:
    """``fits`` for a state walked the same way at every snapshot, in a few list comparisons.

    The first state that fits leaves its signature: its tensors' keys, shapes, dtypes and
    global shapes and its plain values' keys, in the order the walk met them. A later state
    with the same signature fits too (it is ``fits``' test, and stricter in the order); any
    other is checked by ``fits`` itself, so a state walked in another order still fits. A
    snapshot every step then compares hundreds of entries in C, not one by one in Python.
    """

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._signature: tuple[list[Any], ...] | None = None

    def __call__(self, leaves: Leaves) -> bool:
        """Whether ``leaves`` have the layout: ``fits(layout, leaves)``."""
        tensors = leaves.tensors.values()
        signature = (
            list(leaves.tensors),
            [tensor.shape for tensor in tensors],
            [tensor.dtype for tensor in tensors],
            list(leaves.global_shapes.items()),
            list(leaves.values),
        )
        if signature == self._signature:
            return True
        if not fits(self._layout, leaves):
            return False
        self._signature = signature
        return True


def restore_into(
    state: dict[str, Any], layout: Layout, data: torch.Tensor, values: Mapping[str, JSONValue]
) -> None:
    """Write a snapshot into ``state`` as DCP loads a checkpoint, all of it.

    Each tensor of the state (``Stateful`` values asked for their ``state_dict()``) is
    overwritten in place from ``data``; then each ``Stateful`` gets ``load_state_dict`` of its
    state dict with the snapshot's plain values in it, and a plain value at the top of ``state``
    is replaced. The caller checked that ``layout`` is the state's own.
    """
    entries = {e.key: e for e in layout.entries}
    for key, value in list(state.items()):
        template = value.state_dict() if isinstance(value, Stateful) else value
        rebuilt = _rebuild(template, str(key), entries, data, values)
        if isinstance(value, Stateful):
            value.load_state_dict(rebuilt)
        elif not isinstance(value, torch.Tensor):
            state[key] = rebuilt


def _rebuild(
    value: Any,
    key: str,
    entries: Mapping[str, TensorEntry],
    data: torch.Tensor,
    values: Mapping[str, JSONValue],
) -> Any:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if isinstance(value, DTensor) else value
        with torch.no_grad():
            local.copy_(entries[key].view(data))
        return value
    if isinstance(value, Mapping):
        return {k: _rebuild(v, f"{key}/{k}", entries, data, values) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_rebuild(v, f"{key}/{i}", entries, data, values) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return values[key]
