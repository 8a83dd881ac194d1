"""What a checkpoint converts to, checked before anything is read or written.

Each input form (FULL, SHARDED, LOCAL) turns into a :class:`ConversionPlan`: the output's
tensors in groups (an FSDP1 unit, or a layer), each tensor with its key, shape, dtype and a
function that reads it. Every check happens while the plan is made; the writers then read
one tensor at a time, so memory holds one tensor, not the model.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "CheckpointError",
    "ConversionPlan",
    "OutputTensor",
    "TensorCheckpoint",
    "TensorGroup",
    "TensorMeta",
    "by_layer",
    "check_matches",
    "grouped",
    "model_tensors",
    "select_prefix",
]

logger = logging.getLogger(__name__)

TensorMeta = tuple[tuple[int, ...], torch.dtype]
"""A tensor's shape and dtype."""


class CheckpointError(ValueError):
    """An FSDP1 checkpoint that cannot be converted; the message names the file and key."""


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One tensor of the converted checkpoint, read when it is written."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class TensorGroup:
    """Tensors converted together: an FSDP1 unit, or one layer of a full checkpoint."""

    name: str
    tensors: tuple[OutputTensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors' data."""
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True, slots=True)
class ConversionPlan:
    """A checked checkpoint, ready to be written group by group."""

    source: str
    """What is converted, for messages ("LOCAL state dict of 2 ranks", ...)."""
    groups: tuple[TensorGroup, ...]

    def tensors(self) -> Iterable[OutputTensor]:
        """Every output tensor, group by group."""
        for group in self.groups:
            yield from group.tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorCheckpoint:
    """A checkpoint that holds whole tensors by name (FULL and SHARDED)."""

    path: str | os.PathLike[str]
    """The torch.save file, or the DCP checkpoint directory."""
    model: nn.Module | None = None
    """The model, to check the checkpoint against (keys, shapes, dtypes); optional."""
    prefix: str | None = None
    """Where the model's entries are (``model`` when saved as ``{"model": sd, ...}``); None:
    found from the model's keys, or every tensor without a model."""


def model_tensors(
    entries: Mapping[str, TensorMeta | None], spec: TensorCheckpoint, where: str
) -> dict[str, str]:
    """The entries to convert: output key -> entry name, checked against the model if given.

    ``entries`` gives every entry's shape and dtype (None for what is not a tensor). Those
    under the prefix (see :func:`select_prefix`) are taken, without it; what is not a tensor
    is left out, with a warning.

    Raises:
        CheckpointError: no tensor under the prefix, or a mismatch with the model.
    """
    prefix = select_prefix(entries, spec.prefix, spec.model)
    chosen = {k[len(prefix) :]: k for k in entries if k.startswith(prefix)}
    others = sorted(k for k, name in chosen.items() if entries[name] is None)
    if others:
        logger.warning("%s: left out, not tensors: %s", where, others)
    found = {k: meta for k, name in chosen.items() if (meta := entries[name]) is not None}
    if not found:
        raise CheckpointError(f"{where}: no tensors under {prefix or 'the top level'!r}")
    if spec.model is not None:
        check_matches(found, spec.model, where)
    return {k: chosen[k] for k in found}


def check_matches(found: Mapping[str, TensorMeta], model: nn.Module, where: str) -> None:
    """Refuse a checkpoint whose keys, shapes or dtypes are not those of ``model``'s state dict.

    ``found`` maps each key to its (shape, dtype). One error lists every problem.

    Raises:
        CheckpointError: naming ``where`` and each missing, unexpected or mismatched key.
    """
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    lines = [f"  {k}: missing" for k in expected if k not in found]
    lines += [f"  {k}: unexpected" for k in found if k not in expected]
    lines += [
        f"  {k}: {_describe(*found[k])} in the checkpoint, {_describe(*want)} in the model"
        for k, want in expected.items()
        if k in found and found[k] != want
    ]
    if lines:
        raise CheckpointError(
            f"{where} does not match the model ({type(model).__name__}); "
            f"{len(lines)} problem(s):\n" + "\n".join(lines)
        )


def _describe(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def select_prefix(keys: Iterable[str], prefix: str | None, model: nn.Module | None) -> str:
    """The key prefix the model's entries sit under ("" for none, else ending in ".").

    ``prefix`` given: that one (``model`` becomes ``model.``). Otherwise, with a model, the
    prefix under which most of its keys are found (a checkpoint saved as ``{"model": sd}``
    has them under ``model.``); without one, none.

    Raises:
        CheckpointError: a model is given and none of its keys is found under any prefix.
    """
    if prefix is not None:
        return f"{prefix.rstrip('.')}." if prefix else ""
    if model is None:
        return ""
    wanted = set(model.state_dict())
    found: Counter[str] = Counter()
    keys = list(keys)
    for key in keys:
        found.update(key[: i + 1] for i, c in enumerate(key) if c == "." and key[i + 1 :] in wanted)
        if key in wanted:
            found[""] += 1
    if not found:
        raise CheckpointError(
            f"none of the model's keys ({sorted(wanted)[:3]}, ...) is in the checkpoint, under "
            f"any prefix; it holds {sorted(keys)[:5]}{' ...' if len(keys) > 5 else ''}"
        )
    return max(sorted(found), key=lambda p: found[p])


def by_layer(key: str) -> str:
    """The group of a key of a full checkpoint: its numbered layer, else its top module.

    ``blocks.3.attn.qkv.weight`` is in ``blocks.3``, ``tok.weight`` in ``tok``.
    """
    parts = key.split(".")[:-1]
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return parts[0] if parts else key


def grouped(tensors: Iterable[OutputTensor]) -> tuple[TensorGroup, ...]:
    """Tensors in groups by :func:`by_layer`, groups in order of first appearance."""
    groups: dict[str, list[OutputTensor]] = {}
    for tensor in tensors:
        groups.setdefault(by_layer(tensor.key), []).append(tensor)
    return tuple(TensorGroup(name, tuple(members)) for name, members in groups.items())
