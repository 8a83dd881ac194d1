"""Bytes of tensor memory alive in this process, leaving out memory-mapped files.

The converter reads its inputs through memory maps: those pages belong to the files and the
kernel drops them at will, so they are not what "memory held" means. Every other storage an
operator creates (reads into memory, copies, joins) counts from its creation to its free. A
converter that loaded a file without mapping it would be counted whole.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _in_mapped_file(address: int) -> bool:
    """Whether ``address`` lies in a mapping of a file (not anonymous memory or the heap)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return len(fields) >= 6 and fields[5].startswith("/")
    return False


class HeldBytes(TorchDispatchMode):
    """Counts the CPU storages operators create, outside mapped files; keeps the peak."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's, unannotated
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes, while it lives
        self._refs: list[weakref.ref[torch.UntypedStorage]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                self._note(value.untyped_storage())
        return out

    def _note(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)  # a storage's Python object lives as long as the storage
        if key in self._sizes or storage.nbytes() == 0:
            return
        size = 0 if _in_mapped_file(storage.data_ptr()) else storage.nbytes()
        self._sizes[key] = size
        self._refs.append(weakref.ref(storage, lambda _: self._free(key)))
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
