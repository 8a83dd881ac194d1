"""shardkit.legacy: FSDP1's API and checkpoints on shardkit's engine.

- :mod:`~shardkit.legacy.flat_layout`: FSDP1's flat-parameter layout, from the model and
  FSDP1's settings (what LOCAL_STATE_DICT checkpoints need to be read).
- :mod:`~shardkit.legacy.convert`: FSDP1 checkpoints to DCP or safetensors
  (``shardkit-convert``).
"""

from shardkit.legacy.__about__ import __version__
from shardkit.legacy.convert import (
    CheckpointError,
    ConversionResult,
    Fsdp1Checkpoint,
    FullCheckpoint,
    LocalCheckpoint,
    ShardedCheckpoint,
    convert_checkpoint,
)
from shardkit.legacy.flat_layout import (
    FlatParamEntry,
    FlatParamLayout,
    FlatParamUnit,
    ShardPiece,
    WrapPolicy,
    flat_param_layout,
)

__all__ = [
    "CheckpointError",
    "ConversionResult",
    "FlatParamEntry",
    "FlatParamLayout",
    "FlatParamUnit",
    "Fsdp1Checkpoint",
    "FullCheckpoint",
    "LocalCheckpoint",
    "ShardPiece",
    "ShardedCheckpoint",
    "WrapPolicy",
    "__version__",
    "convert_checkpoint",
    "flat_param_layout",
]
