"""shardkit.legacy: FSDP1's API (``FullyShardedDataParallel``) on shardkit's engine.

``from shardkit.legacy import FullyShardedDataParallel as FSDP`` in place of
``from torch.distributed.fsdp import FullyShardedDataParallel as FSDP``: FSDP1 training code
runs with the import changed. See the package README for what maps to what.
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
    "CustomPolicy",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "__version__",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]
