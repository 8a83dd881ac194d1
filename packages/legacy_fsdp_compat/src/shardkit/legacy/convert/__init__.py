"""The FSDP1 checkpoint converter (``shardkit-convert``), in one CPU process.

FULL, SHARDED or LOCAL state dicts of torch's FSDP1 become a DCP checkpoint or a safetensors
file.

- :mod:`~shardkit.legacy.convert.api`: :func:`convert_checkpoint`;
- :mod:`~shardkit.legacy.convert.full`, :mod:`~shardkit.legacy.convert.sharded`,
  :mod:`~shardkit.legacy.convert.local`: each input form, read and checked into a plan;
- :mod:`~shardkit.legacy.convert.plan`: the plan, and the checks shared by the forms;
- :mod:`~shardkit.legacy.convert.safe_load`: reading files with nothing unpickled but data;
- :mod:`~shardkit.legacy.convert.writers`: DCP and safetensors output, a tensor at a time;
- :mod:`~shardkit.legacy.convert.cli`: the console script.
"""

from shardkit.legacy.convert.api import ConversionResult, Fsdp1Checkpoint, convert_checkpoint
from shardkit.legacy.convert.full import FullCheckpoint
from shardkit.legacy.convert.local import LocalCheckpoint
from shardkit.legacy.convert.plan import CheckpointError
from shardkit.legacy.convert.sharded import ShardedCheckpoint

__all__ = [
    "CheckpointError",
    "ConversionResult",
    "Fsdp1Checkpoint",
    "FullCheckpoint",
    "LocalCheckpoint",
    "ShardedCheckpoint",
    "convert_checkpoint",
]
