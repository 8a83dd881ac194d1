"""Checkpoints: the manager of checkpoint directories and the pieces behind it.

``CheckpointManager`` (``manager.py``) saves and loads torch.distributed.checkpoint
directories that an interrupted save or a corrupt file cannot break; ``load_checks.py``
checks a candidate's files before anything of it loads, then loads it (one verdict on every
rank); ``async_save.py`` writes in the background, ``staging.py`` keeps the reused CPU copy of
the state, and ``files.py`` checksums a checkpoint's files; ``dcp_reading.py`` reads a
checkpoint's metadata and plain values without running pickled code (``read_dcp_metadata``);
``save_dcp`` is DCP's ``save`` planned by each rank alone (``planned_save.py``, the same
save the manager makes); ``StateDictCache`` is torch's ``get_state_dict`` for a loop that
asks every step (``state_dict_cache.py``).
``from shardkit.core.checkpoint import CheckpointManager`` works as before (``shardkit.core``
exports the same names). Memory snapshots are a wing of their own, ``shardkit.core.snapshots``.
"""

from shardkit.core.checkpoint.async_save import CheckpointSaveError
from shardkit.core.checkpoint.dcp_reading import read_dcp_metadata
from shardkit.core.checkpoint.manager import (
    CheckpointLoadError,
    CheckpointManager,
    IncompleteCheckpointError,
)
from shardkit.core.checkpoint.planned_save import LayoutCache, save_dcp
from shardkit.core.checkpoint.state_dict_cache import StateDictCache

__all__ = [
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointSaveError",
    "IncompleteCheckpointError",
    "LayoutCache",
    "StateDictCache",
    "read_dcp_metadata",
    "save_dcp",
]
