"""What an export hands a receiver: a manifest first, then buckets of whole layers.

A full export's bucket holds whole tensors; a delta export's holds, for each tensor, the
elements that changed since the previous export (their flat positions in the full tensor and
their new values). Both come in the export dtype, and every tensor of one layer (the ``layer_of``
hook's key) comes in the same bucket, so a loader that fuses q, k and v, or gate and up, sees
them together. The manifest lists every tensor of the export before any bucket, so a receiver
checks names, shapes and dtypes before it writes anything.

These records are plain data, transport-neutral: the shared-memory and process-group
transports encode them as a JSON header plus raw bytes (never pickle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "ChangedElements",
    "ExportKind",
    "ExportManifest",
    "ExportedTensor",
    "WeightBucket",
    "check_changes_fit",
]

ExportKind = Literal["full", "delta"]


@dataclass(frozen=True, slots=True)
class ExportedTensor:
    """One tensor of an export, as the manifest lists it."""

    name: str
    """Its name for the receiver (after the exporter's ``rename`` hook)."""
    shape: tuple[int, ...]
    """Its full shape (under a kept TP axis: this TP rank's part)."""
    dtype: torch.dtype
    """The export dtype it arrives in."""
    bucket: int
    """The index of the bucket it arrives in."""


@dataclass(frozen=True, slots=True)
class ExportManifest:
    """Everything one export will hand over, sent before its first bucket."""

    export_id: int
    """Counts the exporter's exports from 0; a receiver can tell a skipped one."""
    kind: ExportKind
    """``"full"``: buckets hold whole tensors; ``"delta"``: changed elements only, relative
    to export ``export_id - 1`` (which the receiver must hold)."""
    tensors: tuple[ExportedTensor, ...]
    """Every tensor, in bucket order."""
    bucket_count: int
    """How many buckets follow."""

    def names_in(self, bucket: int) -> list[str]:
        """The names of bucket ``bucket``'s tensors, in order."""
        return [t.name for t in self.tensors if t.bucket == bucket]

    def by_name(self) -> dict[str, ExportedTensor]:
        """The manifest's entries by name."""
        return {t.name: t for t in self.tensors}


@dataclass(frozen=True, slots=True)
class ChangedElements:
    """The elements of one tensor that changed since the previous export.

    Most elements an optimizer step changes move by one or a few units in the last place:
    those come as *steps*, the difference of the new value's bits and the old one's read as
    an integer (one byte each on the wire), which the receiver adds to the bits it holds.
    The others come as new values.
    """

    indices: torch.Tensor
    """(n,) int64: ascending positions in the full tensor, flattened row-major."""
    values: torch.Tensor
    """(n,) in the export dtype: the new values at ``indices``."""
    stepped: torch.Tensor | None = None
    """(m,) int64: ascending positions whose bits moved by ``steps`` (None: none)."""
    steps: torch.Tensor | None = None
    """(m,) int8 or int64: new bits minus old bits, as signed integers of the dtype's width
    (a delta export hands int8 steps: its larger ones travel as values)."""

    @property
    def count(self) -> int:
        """How many elements changed."""
        return self.indices.numel() + (0 if self.stepped is None else self.stepped.numel())

    def check_fits(self, name: str, full: torch.Tensor) -> None:
        """Refuse changes that ``full`` cannot take: a position outside it, another dtype.

        Raises:
            ValueError: naming ``name`` and the problem.
        """
        check_changes_fit([(name, self, full)])

    def apply_to(self, full: torch.Tensor) -> None:
        """Write the changes into ``full``.

        (contiguous, the tensor's full shape, holding the previous export's values) in
        place.
        """
        flat = full.view(-1)
        where = full.device  # a receiver may hold its tensors elsewhere (the trainer's GPU, a CPU)
        flat[self.indices.to(where)] = self.values.to(where)
        if self.stepped is not None and self.steps is not None and self.stepped.numel():
            bits = flat.view(_BITS[full.element_size()])
            # Positions are distinct: one scatter-add, where ``+=`` on an index would gather,
            # add and scatter. Integer adds wrap as the sender's subtraction did.
            bits.index_add_(0, self.stepped.to(where), self.steps.to(where, bits.dtype))


def check_changes_fit(items: Sequence[tuple[str, ChangedElements, torch.Tensor]]) -> None:
    """Refuse changes that their tensors cannot take: a position outside one, another dtype.

    ``items``: per tensor, its name, its changes and the tensor that would take them. Every
    tensor's lowest and highest positions are read back together, once per device: where the
    changes live on a GPU each read waits for it (a 150M model's delta, checked tensor by
    tensor, read 568 values back, each alone).

    Raises:
        ValueError: naming each tensor whose changes do not fit, and why.
    """
    problems: dict[str, list[str]] = {}
    bounds: dict[torch.device, list[torch.Tensor]] = {}
    ranged: dict[torch.device, list[tuple[str, str, int]]] = {}
    for name, changes, full in items:
        if changes.values.dtype != full.dtype:
            problems.setdefault(name, []).append(
                f"values are {changes.values.dtype}, the tensor {full.dtype}"
            )
        for what, at, by in (
            ("values", changes.indices, changes.values),
            ("steps", changes.stepped, changes.steps),
        ):
            if at is None or by is None:
                continue
            if at.numel() != by.numel():
                problems.setdefault(name, []).append(
                    f"{at.numel()} positions for {by.numel()} {what}"
                )
            elif at.numel():
                lowest, highest = torch.aminmax(at.to(torch.int64))
                bounds.setdefault(at.device, []).extend((lowest, highest))
                ranged.setdefault(at.device, []).append((name, what, full.numel()))
    for device, pairs in bounds.items():
        read = torch.stack(pairs).tolist()  # one read back for every tensor on the device
        for (name, what, numel), lowest, highest in zip(
            ranged[device], read[0::2], read[1::2], strict=True
        ):
            if lowest < 0 or highest >= numel:
                problems.setdefault(name, []).append(
                    f"a position of its {what} is outside its {numel} elements"
                )
    if problems:
        raise ValueError(
            "; ".join(
                f"{name}: the changes do not fit the tensor: {', '.join(found)}"
                for name, found in problems.items()
            )
        )


# Integers as wide as each element size: a value's bits, read as a number.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class WeightBucket:
    """One bucket of an export: whole layers, as whole tensors or as their changes."""

    index: int
    """Its position in the export, from 0."""
    full: tuple[tuple[str, torch.Tensor], ...] = ()
    """Whole tensors, by name (a full export; in a delta export, none)."""
    changed: tuple[tuple[str, ChangedElements], ...] = ()
    """Changed elements, by name (a delta export: every tensor of the bucket, changed or not)."""

    @property
    def names(self) -> list[str]:
        """The names of the bucket's tensors, in order."""
        return [name for name, _ in self.full] + [name for name, _ in self.changed]
