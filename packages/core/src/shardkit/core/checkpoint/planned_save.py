"""``torch.distributed.checkpoint.save`` without the plan exchange, for any training loop.

``CheckpointManager`` saves this way already; :func:`save_dcp` is the same save for code that
calls DCP's ``save`` itself: FSDP1's SHARDED_STATE_DICT (ShardedTensors, or DTensors with a
device mesh; torch's FSDP1 or ``shardkit.legacy``), or ``fully_shard``'s state dicts. The
files are DCP's, so ``torch.distributed.checkpoint.load`` reads them at any world size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardkit.core.checkpoint.async_save import CheckpointSaveError
from shardkit.core.checkpoint.local_save import LayoutCache, save_planned_locally
from shardkit.core.runtime.groups import checkpoint_group

__all__ = ["LayoutCache", "save_dcp"]


def save_dcp(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    *,
    layout: LayoutCache | None = None,
) -> None:
    """Save ``state_dict`` into the directory ``checkpoint_id`` as ``dcp.save`` would.

    Each rank plans its own part from the sharding (no collective before the files are
    written; ``checkpoint/local_save.py``), then rank 0 gathers what was written and writes
    ``.metadata``. Where the ranks' keys differ (pipeline stages), or a value's chunks cannot
    be placed by each rank alone, the save goes through DCP's own planning instead.

    Collective: every rank of the world calls it. Unlike ``CheckpointManager``, nothing is
    atomic: an interrupted save leaves a directory without ``.metadata`` (or with the last
    save's, if saved over one).

    Args:
        state_dict: what ``dcp.save`` takes (tensors, DTensors, ShardedTensors, ``Stateful``
            objects, other values).
        checkpoint_id: the checkpoint's directory (made if missing).
        layout: keep the plan between saves: pass the same ``LayoutCache`` to every save of
            one training loop, and a save whose layout did not change plans nothing anew.

    Raises:
        CheckpointSaveError: on every rank, the same text: a rank failed to write, or a
            rank's results did not match its plan.
    """
    folder = Path(checkpoint_id)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        save_planned_locally(
            state_dict, folder, layout if layout is not None else LayoutCache(), checkpoint_group()
        )
    except RuntimeError as error:  # raised on every rank, the same text
        raise CheckpointSaveError(f"the save into {folder} failed: {error}") from None
