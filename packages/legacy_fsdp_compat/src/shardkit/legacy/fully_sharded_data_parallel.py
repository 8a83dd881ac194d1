"""FSDP1's names at the module path FSDP1 code imports them from.

FSDP1 scripts (its tutorials among them) import the wrapper and its configs from
``torch.distributed.fsdp.fully_sharded_data_parallel``; with this module, changing
``torch.distributed.fsdp`` to ``shardkit.legacy`` in such an import is the whole migration.
"""

from shardkit.legacy import configs as _configs
from shardkit.legacy.configs import *  # noqa: F403  (every FSDP1 config: configs.__all__)
from shardkit.legacy.wrapper import FullyShardedDataParallel

# The configs are listed once, in configs.py; the star import re-exports them (for mypy too).
__all__ = ["FullyShardedDataParallel"]
__all__ += _configs.__all__
