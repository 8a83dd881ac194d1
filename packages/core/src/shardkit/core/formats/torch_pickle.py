"""What a torch.save pickle claims, read without running anything of the file's.

Both of torch.save's formats pickle the object with each storage replaced by a persistent id,
``("storage", storage type, key, location, numel, ...)``; the storage's bytes are elsewhere
(a zip record ``data/<key>``, or after the pickles in the legacy format). torch allocates each
storage at the size its id declares before comparing it with the file, so the declared sizes
are checked first, from this module's reading of the pickle:

- every global the pickle names (a class, a function) is a harmless placeholder, so no code
  of the file's runs;
- Python's unpickler, not C's, reading from a file whose reads never ask for more than is
  left: C's allocates a ``BINBYTES`` string at its declared length before reading it;
- each storage's first declaration is kept with the key path of the first tensor that uses
  it (``model.inp.weight``), so an error names the tensor.

See [Note: file readers].
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = ["StorageClaim", "read_pickle", "read_storage_claims"]


@dataclass(frozen=True, slots=True)
class StorageClaim:
    """One storage as a pickle declares it."""

    key: str
    """The storage's key: its zip record is ``data/<key>``."""
    type_name: str
    """Its storage type as the pickle names it (``FloatStorage``, ``UntypedStorage``)."""
    numel: int
    """Elements declared (bytes for ``UntypedStorage``)."""
    tensor: str
    """The key path of the first tensor found on it (``model.inp.weight``), or ``?``."""

    def itemsize(self) -> int | None:
        """Bytes per element; None for a storage type torch cannot load."""
        return _itemsizes().get(self.type_name)

    def nbytes(self) -> int | None:
        """Declared bytes; None for a storage type or size torch cannot load."""
        itemsize = self.itemsize()
        if itemsize is None or self.numel < 0:
            return None
        return self.numel * itemsize


class _Placeholder:
    """Whatever the pickle builds from a global: keeps its arguments, state and items."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # A call's arguments add nothing to a key path (a tensor's storage is one of them).
        self._keep(*args, *kwargs.values())

    def _keep(self, *parts: Any) -> None:
        # NEWOBJ makes an instance without calling __init__: the list is made on first use.
        self.__dict__.setdefault("parts", []).extend(parts)

    def __setstate__(self, state: Any) -> None:
        self._keep(state)

    def __setitem__(self, key: Any, value: Any) -> None:  # an OrderedDict's items
        self._keep({key: value})

    def append(self, value: Any) -> None:  # a list subclass's items
        self._keep(value)

    def extend(self, values: Any) -> None:
        self._keep(list(values))

    def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
        # A global's attribute (a pickled getattr), called in turn.
        return _Placeholder(self, *args, *kwargs.values())


@dataclass(frozen=True, slots=True)
class _StorageId:
    """A persistent id as the pickle declared it (numel not yet checked)."""

    key: str
    type_name: str
    numel: int


class _ClaimsUnpickler(pickle._Unpickler):
    """Unpickles with placeholders for globals, recording the storages that are declared."""

    read: Callable[[int], bytes]  # set by pickle's load()
    stack: list[Any]  # likewise

    def __init__(self, file: io.RawIOBase | io.BytesIO) -> None:
        super().__init__(file)
        self.declared: list[_StorageId] = []

    def load_proto(self) -> None:
        """Any protocol number, as torch's unpickler takes it (Python's wants 5 or less)."""
        self.read(1)

    def find_class(self, module: str, name: str) -> Any:
        # A class of its own per global: a type (as NEWOBJ wants), named as the file named it.
        return type(name, (_Placeholder,), {})

    def load_newobj(self) -> None:
        """``cls.__new__(cls, *args)``, where ``cls`` may be a placeholder instance."""
        args = self.stack.pop()
        self.stack[-1] = _new(self.stack[-1], args)

    def load_newobj_ex(self) -> None:
        """``cls.__new__(cls, *args, **kwargs)``, as :meth:`load_newobj`."""
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = _new(self.stack[-1], (*args, *kwargs.values()))

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] in ("storage", b"storage"):
            storage_type, key, numel = pid[1], pid[2], pid[4]
            if isinstance(numel, int) and isinstance(storage_type, type):
                key = key.decode("ascii", "replace") if isinstance(key, bytes) else str(key)
                found = _StorageId(key, storage_type.__name__, numel)
                self.declared.append(found)
                return found
        return _Placeholder()


def _new(cls: Any, args: tuple[Any, ...]) -> Any:
    if isinstance(cls, type) and issubclass(cls, _Placeholder):
        return cls.__new__(cls)
    return _Placeholder(cls, *args)


def _opcode(method: Callable[[_ClaimsUnpickler], None]) -> Callable[[pickle.Unpickler], None]:
    return cast(Callable[[pickle.Unpickler], None], method)


# BYTEARRAY8 allocates its declared length first in both unpicklers; torch never writes it.
_ClaimsUnpickler.dispatch = {
    **{k: v for k, v in pickle._Unpickler.dispatch.items() if k != pickle.BYTEARRAY8[0]},
    pickle.PROTO[0]: _opcode(_ClaimsUnpickler.load_proto),
    pickle.NEWOBJ[0]: _opcode(_ClaimsUnpickler.load_newobj),
    pickle.NEWOBJ_EX[0]: _opcode(_ClaimsUnpickler.load_newobj_ex),
}


def _itemsizes() -> dict[str, int]:
    """Bytes per element of each storage type, by its name (``FloatStorage``: 4)."""
    # torch names no public map from storage type to dtype; file_writers uses the same one.
    names = torch.storage._dtype_to_storage_type_map()
    # UntypedStorage counts bytes: torch.save uses it for dtypes without a typed storage.
    return {"UntypedStorage": 1} | {name: dtype.itemsize for dtype, name in names.items()}


def read_storage_claims(file: io.RawIOBase | io.BytesIO, pickles: int) -> list[StorageClaim]:
    """The storages that the ``pickles``-th pickle in ``file`` declares, first declaration each.

    ``file`` must never return more than it holds for a read (a :class:`io.BytesIO`, or
    ``torch_legacy.BoundedFile``): a declared length then costs at most the file's size.

    Raises:
        Exception: whatever a broken pickle raises (EOFError, KeyError, UnpicklingError, ...).
    """
    unpickler = _ClaimsUnpickler(file)
    loaded: Any = None
    for _ in range(pickles):
        loaded = unpickler.load()
    paths = dict(_storage_paths(loaded))
    claims: dict[str, StorageClaim] = {}
    for found in unpickler.declared:
        if found.key not in claims:
            tensor = paths.get(id(found), "?")
            claims[found.key] = StorageClaim(found.key, found.type_name, found.numel, tensor)
    return list(claims.values())


def read_pickle(file: io.RawIOBase | io.BytesIO) -> Any:
    """The next pickle in ``file``, every global in it a placeholder (for plain data)."""
    return _ClaimsUnpickler(file).load()


def _storage_paths(root: Any) -> Iterator[tuple[int, str]]:
    """``(id(storage id), key path)`` for each storage id reachable from ``root``.

    Breadth first, so each storage gets its shortest path; iterative, with each object visited
    once, since a pickle can nest deeply and refer to itself.
    """
    seen: set[int] = set()
    level: list[tuple[Any, tuple[str, ...]]] = [(root, ())]
    while level:
        following: list[tuple[Any, tuple[str, ...]]] = []
        for value, path in level:
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, _StorageId):
                yield id(value), ".".join(path) or "(the top object)"
            elif isinstance(value, dict):
                following += [(v, (*path, _step(k))) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                following += [(v, (*path, str(i))) for i, v in enumerate(value)]
            elif isinstance(value, _Placeholder):
                following += [(part, path) for part in value.__dict__.get("parts", [])]
        level = following


def _step(key: Any) -> str:
    if isinstance(key, bytes):
        return key.decode("utf-8", "replace")
    return str(key)
