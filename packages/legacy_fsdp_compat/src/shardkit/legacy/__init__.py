"""shardkit.legacy: FSDP1's API and checkpoints on shardkit's engine.

``from shardkit.legacy import FullyShardedDataParallel as FSDP`` in place of
``from torch.distributed.fsdp import FullyShardedDataParallel as FSDP``: FSDP1 training code
runs with the import changed. See the package README for what maps to what.

- :mod:`~shardkit.legacy.flat_layout`: FSDP1's flat-parameter layout, from the model and
  FSDP1's settings (what LOCAL_STATE_DICT checkpoints need to be read).
- :mod:`~shardkit.legacy.convert`: FSDP1 checkpoints to DCP or safetensors
  (``shardkit-convert``).
"""

from shardkit.legacy.__about__ import __version__
from shardkit.legacy.configs import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
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
from shardkit.legacy.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from shardkit.legacy.wrapper import FullyShardedDataParallel

FSDP = FullyShardedDataParallel
"""The name FSDP1 code usually imports it under."""

__all__ = [
    "FSDP",
    "BackwardPrefetch",
    "CPUOffload",
    "CheckpointError",
    "ConversionResult",
    "CustomPolicy",
    "FlatParamEntry",
    "FlatParamLayout",
    "FlatParamUnit",
    "Fsdp1Checkpoint",
    "FullCheckpoint",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalCheckpoint",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardPiece",
    "ShardedCheckpoint",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "WrapPolicy",
    "__version__",
    "always_wrap_policy",
    "convert_checkpoint",
    "flat_param_layout",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]
