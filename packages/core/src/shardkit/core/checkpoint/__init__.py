"""Checkpoints: the manager of checkpoint directories and the pieces behind it.

``CheckpointManager`` (``manager.py``) saves and loads torch.distributed.checkpoint
directories that an interrupted save or a corrupt file cannot break. Behind it:

- saving: ``local_plan/``, the save each rank plans alone from the sharding (DCP's files, no
  plan exchange; ``save_dcp`` is that save as a drop-in for ``dcp.save``); ``async_save.py``
  writes it in the background, ``staging.py`` keeps the reused CPU copy of the state, and
  ``process_writer.py`` moves the writing into a writer process per rank;
- loading: ``load_checks.py`` checks a candidate's files before anything of it loads, then
  loads it (one verdict on every rank); ``replica_reads.py`` splits an HSDP load's reading
  among the replicas, then shares it; ``dcp_reading.py`` reads a checkpoint's metadata and
  plain values without running pickled code (``read_dcp_metadata``);
- ``files.py`` checksums a checkpoint's files; ``publish.py`` makes a finished save current
  (the ``COMPLETE`` marker with those checksums, the renames, ``latest``, the pruning, and
  deletes ordered so that no reader takes a half-deleted directory whole).

The checkpoint's errors (``CheckpointSaveError``, ``CheckpointLoadError``,
``IncompleteCheckpointError``) are ``shardkit.core.errors``'. ``StateDictCache`` (torch's
``get_state_dict`` for a loop that asks every step) lives in ``shardkit.core.state_dict``.
``from shardkit.core.checkpoint import CheckpointManager`` works as before, and so do these
names (``shardkit.core`` exports them too). Memory snapshots are a wing of their own,
``shardkit.core.snapshots``.
"""

from shardkit.core.checkpoint.dcp_reading import read_dcp_metadata
from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_dcp
from shardkit.core.checkpoint.manager import CheckpointManager
from shardkit.core.errors import (
    CheckpointLoadError,
    CheckpointSaveError,
    IncompleteCheckpointError,
)
from shardkit.core.state_dict.cache import StateDictCache

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
