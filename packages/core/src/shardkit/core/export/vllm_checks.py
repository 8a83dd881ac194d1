"""What a vLLM engine can take: an export's manifest checked against the engine, by name.

An engine computes in one dtype and was started from a checkpoint whose names and shapes its
safetensors headers give. A manifest that sends another floating dtype, or a name or shape the
checkpoint lacks, is refused before a byte is written. Both the in-process receiver
(``vllm.py``) and the server's worker (``vllm_server_worker.py``) check with these.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ExportManifest

__all__ = ["check_manifest", "checkpoint_shapes"]

logger = logging.getLogger(__name__)


def check_manifest(
    manifest: ExportManifest, dtype: torch.dtype, checkpoint: dict[str, tuple[int, ...]] | None
) -> None:
    """Refuse ``manifest`` where an engine computing in ``dtype`` on ``checkpoint`` cannot take it.

    Raises:
        WeightLoadError: every tensor it cannot take, named (floating tensors in another
            dtype; names or shapes the checkpoint lacks, where there is one).
    """
    problems = [
        f"{entry.name}: sent as {entry.dtype}, the engine computes in {dtype}"
        for entry in manifest.tensors
        if entry.dtype.is_floating_point and entry.dtype != dtype
    ]
    shapes = checkpoint if checkpoint is not None else {}  # none: names and shapes unchecked
    for entry in manifest.tensors if checkpoint is not None else ():
        shape = shapes.get(entry.name)
        if shape is None:
            problems.append(f"{entry.name}: not a tensor of the engine's checkpoint")
        elif shape != entry.shape:
            problems.append(
                f"{entry.name}: sent as {list(entry.shape)}, the engine's checkpoint "
                f"holds {list(shape)}"
            )
    if problems:
        raise WeightLoadError(
            f"export {manifest.export_id} does not fit the vLLM engine; nothing was written: "
            + "; ".join(problems)
        )


def checkpoint_shapes(source: object) -> dict[str, tuple[int, ...]] | None:
    """The names and shapes of the checkpoint at ``source``, read from its safetensors headers.

    None where ``source`` (vLLM's ``model_config.model``) is not a local folder of
    safetensors files.
    """
    folder = Path(source) if isinstance(source, str) else None
    files = sorted(folder.glob("*.safetensors")) if folder is not None and folder.is_dir() else []
    if not files:
        logger.info(
            "vLLM receiver: no local safetensors checkpoint; manifests checked for dtype only"
        )
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            names: list[str] = list(opened.keys())  # a safetensors handle is not iterable
            for name in names:
                shapes[name] = tuple(opened.get_slice(name).get_shape())
    return shapes
