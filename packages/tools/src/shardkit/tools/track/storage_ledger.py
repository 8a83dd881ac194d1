"""The storages a MemoryTracker has seen: their sizes over time and what they are for.

Every change of live bytes (a storage seen for the first time, resized, or freed) is logged as
an event. What a storage is for is often learnt only later (an optimizer's state becomes known
when its step returns; a buffer handed to a collective is a communication buffer), so events
carry the storage's key and categories are applied when the log is replayed: see
``memory_replay``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from shardkit.tools.records import Category, Phase

__all__ = [
    "PRIORITY",
    "Entry",
    "Event",
    "StorageLedger",
    "Where",
    "has_own_storage",
    "keeps_own_storage",
]

Where = tuple[float, str, Phase, int]

PRIORITY = {category: rank for rank, category in enumerate(Category)}
"""A storage keeps its most specific category (Category lists them most specific first)."""


@dataclass(slots=True)
class Entry:
    """One storage: where and when it appeared, and the best category known for it."""

    key: int
    nbytes: int
    created_s: float
    created_phase: Phase
    hint: Category | None = None
    freed_s: float | None = None


class Event(NamedTuple):
    """Live bytes changed by ``delta`` for storage ``key`` at ``t_s``.

    A named tuple rather than a dataclass: one is made per allocation and free, and tuples
    are the cheapest objects to make.
    """

    t_s: float
    key: int
    delta: int
    module: str
    phase: Phase
    step: int


class StorageLedger:
    """Storages by identity, and the log of their size changes."""

    def __init__(self, device_type: str, where: Callable[[], Where]) -> None:
        self.device_type = device_type
        self.where = where
        """Gives (time, module, phase, step) to stamp on an event."""
        self.entries: dict[int, Entry] = {}  # key -> entry, until replayed after its free
        self.events: list[Event] = []
        # id(storage) -> Entry. A storage's Python object lives exactly as long as the storage
        # (torch preserves it), and the free callback removes the id, so ids are never stale.
        self._by_id: dict[int, Entry] = {}
        # The weak references whose callbacks log frees -> (entry, id of its storage). One
        # bound method serves every storage: no closure made per allocation.
        self._by_ref: dict[Any, tuple[Entry, int]] = {}
        self._keys = itertools.count()

    def knows(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is tracked already."""
        return id(storage) in self._by_id

    def track(self, storage: torch.UntypedStorage, hint: Category | None = None) -> Entry | None:
        """Know ``storage`` (logging its bytes as live now if new) and apply ``hint``."""
        if storage.device.type != self.device_type:
            return None
        entry = self._by_id.get(id(storage))
        if entry is None:
            t, module, phase, step = self.where()
            entry = Entry(next(self._keys), storage.nbytes(), t, phase)
            ref = weakref.ref(storage, self._freed)
            self._by_ref[ref] = (entry, id(storage))
            self._by_id[id(storage)] = entry
            self.entries[entry.key] = entry
            if entry.nbytes:
                self.events.append(Event(t, entry.key, entry.nbytes, module, phase, step))
        if hint is not None and (entry.hint is None or PRIORITY[hint] < PRIORITY[entry.hint]):
            entry.hint = hint
        return entry

    def track_tensor(self, tensor: torch.Tensor, hint: Category | None = None) -> None:
        """Track the storage behind ``tensor`` (a DTensor's local shard for a DTensor)."""
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if has_own_storage(local):
            self.track(local.untyped_storage(), hint)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Log a resize of ``storage`` (tracking it if new)."""
        entry = self._by_id.get(id(storage))
        if entry is None:
            self.track(storage)
            return
        nbytes = storage.nbytes()
        if nbytes != entry.nbytes:
            t, module, phase, step = self.where()
            self.events.append(Event(t, entry.key, nbytes - entry.nbytes, module, phase, step))
            entry.nbytes = nbytes

    def _freed(self, ref: Any) -> None:
        found = self._by_ref.pop(ref, None)
        if found is None:
            return
        entry, storage_id = found
        self._by_id.pop(storage_id, None)
        t, module, phase, step = self.where()
        entry.freed_s = t
        if entry.nbytes:
            self.events.append(Event(t, entry.key, -entry.nbytes, module, phase, step))

    def take_events(self) -> list[Event]:
        """The events logged since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def forget_freed(self) -> None:
        """Drop entries whose storage is gone (after their events were replayed)."""
        for key in [k for k, e in self.entries.items() if e.freed_s is not None]:
            del self.entries[key]


_OWN_STORAGE: dict[type, bool] = {}  # tensor class -> does it keep its data in its storage


def has_own_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage holds its data.

    Not for meta tensors, nor for wrapper subclasses (DTensor, fake or functional tensors),
    whose storage is a stand-in.
    """
    return keeps_own_storage(type(tensor)) and not tensor.is_meta


def keeps_own_storage(kind: type[torch.Tensor]) -> bool:
    """Whether tensors of class ``kind`` keep their data in their storage (see above)."""
    own = _OWN_STORAGE.get(kind)
    if own is None:
        own = _OWN_STORAGE[kind] = kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    return own
