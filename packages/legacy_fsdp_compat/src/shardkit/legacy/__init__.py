"""shardkit.legacy: FSDP1's API and checkpoints on shardkit's engine.

- :mod:`~shardkit.legacy.flat_layout`: FSDP1's flat-parameter layout, from the model and
  FSDP1's settings (what LOCAL_STATE_DICT checkpoints need to be read).
"""

from shardkit.legacy.__about__ import __version__
from shardkit.legacy.flat_layout import (
    FlatParamEntry,
    FlatParamLayout,
    FlatParamUnit,
    ShardPiece,
    WrapPolicy,
    flat_param_layout,
)

__all__ = [
    "FlatParamEntry",
    "FlatParamLayout",
    "FlatParamUnit",
    "ShardPiece",
    "WrapPolicy",
    "__version__",
    "flat_param_layout",
]
