"""What a memory snapshot holds: a state's tensors as one range of bytes, its other values as JSON.

A state is what ``CheckpointManager.save`` takes (DCP's form): tensors, DTensors, ``Stateful``
objects, nested dicts, lists and tuples, plain values. It is walked into leaves keyed by their
place ("train/model/blocks.0.attn.qkv.weight"). A tensor leaf (for a DTensor, its local shard)
gets a place in the snapshot's data bytes, 64-byte aligned; every other leaf must be a JSON
value (None, a bool, an int, a float, a string) and travels in the header. Nothing is pickled,
so a snapshot can only ever give back tensors and plain values.

The model fingerprint is what a snapshot must match to be restored into a state: every key,
with its global shape and dtype for a tensor. The layout adds each local shard's shape, which
the world size and the mesh decide.

Copying a state's tensors into a snapshot's bytes, checking that a state still has a layout,
and writing a snapshot back into a state in place: ``state_copy``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from shardkit.core.runtime.dtensors import local_of

__all__ = [
    "DATA_ALIGN",
    "JSON_LEAVES",
    "JSONValue",
    "Layout",
    "Leaves",
    "TensorEntry",
    "dtype_named",
    "leaves_of",
    "whole_number",
]

DATA_ALIGN = 64  # bytes: every tensor starts on a cache line (and any dtype's alignment)
JSON_LEAVES = (type(None), bool, int, float, str)  # the plain values a snapshot holds
_EXACT_JSON = frozenset(JSON_LEAVES)  # those types themselves (subclasses take the long way)

JSONValue = None | bool | int | float | str


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor leaf lives in a snapshot's data bytes."""

    key: str
    dtype: str  # torch's name without "torch.": "float32"
    shape: tuple[int, ...]  # this rank's tensor (a DTensor's local shard)
    global_shape: tuple[int, ...]  # the whole tensor (a DTensor's global shape)
    offset: int  # into the data bytes
    nbytes: int

    def view(self, data: torch.Tensor) -> torch.Tensor:
        """This entry's bytes in ``data`` (uint8) as a tensor of its dtype and shape (no copy)."""
        raw = data[self.offset : self.offset + self.nbytes]
        return raw.view(dtype_named(self.dtype)).view(self.shape)

    def to_json(self) -> list[Any]:
        """The entry as a JSON row: key, dtype, shape, global shape, offset."""
        return [self.key, self.dtype, list(self.shape), list(self.global_shape), self.offset]


@dataclass(frozen=True, slots=True)
class Leaves:
    """A state's leaves: tensors (this rank's bytes of each) and JSON values, by key."""

    tensors: dict[str, torch.Tensor]
    global_shapes: dict[str, tuple[int, ...]]
    values: dict[str, JSONValue]


def leaves_of(state: Mapping[str, Any]) -> Leaves:
    """Walk ``state`` (``Stateful`` values replaced by their ``state_dict()``) into leaves.

    Raises:
        TypeError: a leaf is neither a tensor nor a JSON value (named by its key).
    """
    leaves = Leaves({}, {}, {})
    for key, value in state.items():
        _walk(value.state_dict() if isinstance(value, Stateful) else value, str(key), leaves)
    return leaves


def _walk(value: Any, key: str, leaves: Leaves) -> None:
    if key in leaves.tensors or key in leaves.values:
        raise ValueError(f"memory snapshot: two values of the state have the key {key!r}")
    if type(value) in _EXACT_JSON:  # first: a state's most common leaf, and the cheapest test
        leaves.values[key] = value
    elif isinstance(value, DTensor):
        leaves.tensors[key] = local_of(value)  # no autograd view: read, never differentiated
        leaves.global_shapes[key] = tuple(value.shape)
    elif isinstance(value, torch.Tensor):
        leaves.tensors[key] = value
        leaves.global_shapes[key] = tuple(value.shape)
    elif type(value) is dict or isinstance(value, Mapping):  # a plain dict skips the ABC test
        for name, item in value.items():
            _walk(item, f"{key}/{name}", leaves)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _walk(item, f"{key}/{index}", leaves)
    elif isinstance(value, JSON_LEAVES):
        leaves.values[key] = value
    else:
        raise TypeError(
            f"memory snapshot: {key!r} is a {type(value).__name__}; a snapshot holds tensors "
            "and JSON values (None, bool, int, float, str) only, and never pickles"
        )


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype called ``name`` ("float32"); ValueError if there is none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each tensor of a state goes in the data bytes, and what identifies the model."""

    entries: tuple[TensorEntry, ...]
    value_keys: tuple[str, ...]
    data_bytes: int

    @staticmethod
    def of(leaves: Leaves) -> Layout:
        """The layout of ``leaves``, tensors in key order."""
        entries: list[TensorEntry] = []
        offset = 0
        for key in sorted(leaves.tensors):
            tensor = leaves.tensors[key]
            nbytes = tensor.numel() * tensor.element_size()
            dtype = str(tensor.dtype).removeprefix("torch.")
            shape, global_shape = tuple(tensor.shape), leaves.global_shapes[key]
            entries.append(TensorEntry(key, dtype, shape, global_shape, offset, nbytes))
            offset += -(-nbytes // DATA_ALIGN) * DATA_ALIGN
        return Layout(tuple(entries), tuple(sorted(leaves.values)), offset)

    def model(self) -> list[list[Any]]:
        """The model fingerprint's contents: each key, with global shape and dtype for a tensor."""
        tensors = [[e.key, e.dtype, list(e.global_shape)] for e in self.entries]
        return sorted(tensors + [[key, "value"] for key in self.value_keys])

    def fingerprint(self) -> str:
        """A digest of ``model()``: equal for the same model at any world size."""
        return _digest(self.model())

    def local_shapes(self) -> str:
        """A digest of every tensor's local shape: equal for the same model, mesh and rank."""
        return _digest([[e.key, list(e.shape)] for e in self.entries])

    def to_json(self) -> dict[str, Any]:
        """The layout as JSON (its entries and the plain values' keys)."""
        return {
            "entries": [e.to_json() for e in self.entries],
            "values": list(self.value_keys),
            "data_bytes": self.data_bytes,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Layout:
        """The layout ``to_json`` wrote (ValueError, KeyError or TypeError if it is malformed).

        Read from shared memory, so nothing is taken on trust: every field must have the type
        and range a writer gives it, and every tensor must lie inside the data, aligned.
        """
        rows, value_keys = data["entries"], data["values"]
        if not isinstance(rows, list) or not isinstance(value_keys, list):
            raise ValueError("the layout's entries and plain values must be arrays")
        if not all(isinstance(key, str) for key in value_keys):
            raise ValueError("the plain values' keys must be strings")
        layout = Layout(
            tuple(_entry_of(row) for row in rows),
            tuple(value_keys),
            whole_number(data["data_bytes"], "data_bytes"),
        )
        keys = [e.key for e in layout.entries] + list(layout.value_keys)
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice in the layout")
        end = layout.data_bytes
        if any(e.offset % DATA_ALIGN or e.offset + e.nbytes > end for e in layout.entries):
            raise ValueError("a tensor lies outside the snapshot's data, or not aligned")
        if layout.data_bytes % DATA_ALIGN:
            raise ValueError(f"the data's size is not a multiple of {DATA_ALIGN} bytes")
        return layout

    def first_difference(self, other: Layout) -> str:
        """The first key where ``other``'s model differs from this one's ('' if none)."""
        mine = {row[0]: row[1:] for row in self.model()}
        theirs = {row[0]: row[1:] for row in other.model()}
        tensors = {e.key for e in self.entries} | {e.key for e in other.entries}
        # Tensors first: a parameter that differs says more than the optimizer's lists do.
        for key in sorted(tensors) + sorted(mine.keys() | theirs.keys()):
            if mine.get(key) != theirs.get(key):
                there, here = _describe(theirs.get(key)), _describe(mine.get(key))
                return f"{key}: {there} in the snapshot, {here} here"
        return ""


def _entry_of(row: Any) -> TensorEntry:
    """One layout row (key, dtype, shape, global shape, offset), its types and ranges checked."""
    if not isinstance(row, list) or len(row) != 5:
        raise ValueError(f"a layout entry is [key, dtype, shape, global shape, offset]: {row!r}")
    key, dtype, shape, global_shape, offset = row
    if not isinstance(key, str) or not isinstance(dtype, str):
        raise ValueError(f"a layout entry's key and dtype must be strings: {row!r}")
    for sizes in (shape, global_shape):
        if not isinstance(sizes, list) or len(sizes) != len(shape):
            raise ValueError(f"{key!r}: its shapes must be arrays of one length")
        for size in sizes:
            whole_number(size, f"{key!r}'s shape")
    itemsize = torch.empty((), dtype=dtype_named(dtype)).element_size()
    nbytes = math.prod(shape) * itemsize
    offset = whole_number(offset, f"{key!r}'s offset")
    return TensorEntry(key, dtype, tuple(shape), tuple(global_shape), offset, nbytes)


def whole_number(value: Any, name: str, *, least: int = 0) -> int:
    """``value`` if it is a whole number from ``least`` up that a snapshot can hold.

    Not a bool or a float, and below 2**62: a size, offset, shape, step, rank or world size.
    """
    if type(value) is not int or not least <= value < 2**62:
        raise ValueError(f"{name} {value!r} is not a whole number of at least {least}")
    return value


def _describe(row: list[Any] | None) -> str:
    if row is None:
        return "absent"
    if row == ["value"]:
        return "a plain value"
    return f"{row[0]} {row[1]}"


def _digest(rows: list[list[Any]]) -> str:
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()
