"""FULL_STATE_DICT checkpoints: one torch.save file of full tensors under clean names.

FSDP1 writes them as ``torch.save(model.state_dict())`` on rank 0, sometimes inside a larger
dict (``{"model": ..., "optim": ...}``). The file is memory-mapped, so a tensor is read from
disk when it is written out, and none stays in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardkit.legacy.convert.plan import (
    CheckpointError,
    ConversionPlan,
    OutputTensor,
    TensorCheckpoint,
    TensorMeta,
    grouped,
    model_tensors,
)
from shardkit.legacy.convert.safe_load import ShardedTensorRecord, load_torch_file

__all__ = ["FullCheckpoint", "full_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FullCheckpoint(TensorCheckpoint):
    """An FSDP1 FULL_STATE_DICT saved with ``torch.save``: one file of full tensors.

    ``path`` is the file; ``model`` and ``prefix`` as in :class:`TensorCheckpoint`.
    """


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` for the leaves of nested dicts, as DCP names them."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def full_plan(spec: FullCheckpoint) -> ConversionPlan:
    """Read and check the file's index (its data stays on disk); the plan by layer.

    Raises:
        CheckpointError: the file is unreadable, refused, not a dict, a LOCAL state dict,
            or does not match the model.
    """
    path = Path(spec.path)
    loaded = load_torch_file(path)
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
    leaves = dict(flatten(loaded))
    local = [k for k, v in leaves.items() if isinstance(v, ShardedTensorRecord)]
    if local:
        raise CheckpointError(
            f"{path}: holds ShardedTensors ({local[:2]} ...): an FSDP1 LOCAL_STATE_DICT "
            "file; convert all ranks' files with the local mode"
        )
    meta = {
        k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
        for k, v in leaves.items()
    }
    chosen = model_tensors(meta, spec, str(path))
    return ConversionPlan(
        source=f"FULL state dict {path}",
        groups=grouped(
            OutputTensor(key, *_known(meta[name]), _reader(leaves[name]))
            for key, name in chosen.items()
        ),
    )


def _known(meta: TensorMeta | None) -> TensorMeta:
    assert meta is not None, "model_tensors keeps tensors only"
    return meta


def _reader(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor
