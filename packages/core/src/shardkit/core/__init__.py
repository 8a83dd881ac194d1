"""shardkit.core: fully sharded data parallel training, a drop-in for torch's ``fully_shard``.

``from shardkit.core import fully_shard`` in place of ``from torch.distributed.fsdp import
fully_shard``: same signature, same semantics, our own engine.
"""

# The installed torch is checked before the other imports (hence E402 below), as those are
# what an untested torch may break: the warning that names the tested range comes first.
# ruff: noqa: E402
from shardkit.core.__about__ import __version__
from shardkit.core.torch_release import UntestedTorchWarning, warn_if_untested

warn_if_untested()

from shardkit.core.api import fully_shard, register_fsdp_forward_method
from shardkit.core.checkpoint import CheckpointManager, LayoutCache, read_dcp_metadata, save_dcp
from shardkit.core.comm_sharing import share_comm_ctx
from shardkit.core.errors import (
    AllGatherHookError,
    AllGatherInputError,
    CheckpointLoadError,
    CheckpointSaveError,
    DesyncError,
    FullyShardUsageError,
    IncompleteCheckpointError,
    InvalidPlacementError,
    InvalidShardDimError,
    NumericsCheckError,
    ShardkitError,
    StateDictFileError,
    StuckCollectiveError,
    UnevenShardingError,
    UnsupportedCopyError,
    UnsupportedWithHooksError,
)
from shardkit.core.extensions import ParamShardingSpec, ShardingExtension, register_extension
from shardkit.core.fsdp_handles import GradientReductionHandle, UnshardHandle
from shardkit.core.fsdp_module import FSDPModule
from shardkit.core.full_params import full_params
from shardkit.core.layout import layout_of
from shardkit.core.observe import (
    CollectiveEvent,
    CollectiveIssuedEvent,
    StateTransitionEvent,
    subscribe,
)
from shardkit.core.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from shardkit.core.reduce_precision import ReducePrecision
from shardkit.core.replicate_api import ReplicateModule, replicate
from shardkit.core.runtime.watch.progress import set_collective_bound, set_debug, set_hang_timeout
from shardkit.core.runtime.watch.step_check import set_step_checks
from shardkit.core.snapshots import MemorySnapshots, ResumePoint, SnapshotError
from shardkit.core.state_dict import (
    StateDictCache,
    iter_full_state_dict,
    load_full_state_dict,
    load_torch_file,
    save_full_state_dict,
    write_state_dict_file,
)
from shardkit.core.torch_patch import is_torch_patched, patch_torch, patched_torch, unpatch_torch

__all__ = [
    "AllGatherHookError",
    "AllGatherInputError",
    "CPUOffloadPolicy",
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointSaveError",
    "CollectiveEvent",
    "CollectiveIssuedEvent",
    "DataParallelMeshDims",
    "DesyncError",
    "FSDPModule",
    "FullyShardUsageError",
    "GradientReductionHandle",
    "IncompleteCheckpointError",
    "LayoutCache",
    "InvalidPlacementError",
    "InvalidShardDimError",
    "MemorySnapshots",
    "MixedPrecisionPolicy",
    "NumericsCheckError",
    "OffloadPolicy",
    "ParamShardingSpec",
    "ReducePrecision",
    "ReplicateModule",
    "ResumePoint",
    "ShardingExtension",
    "ShardkitError",
    "SnapshotError",
    "StateDictCache",
    "StateDictFileError",
    "StateTransitionEvent",
    "StuckCollectiveError",
    "UnevenShardingError",
    "UnshardHandle",
    "UntestedTorchWarning",
    "UnsupportedCopyError",
    "UnsupportedWithHooksError",
    "__version__",
    "full_params",
    "fully_shard",
    "is_torch_patched",
    "iter_full_state_dict",
    "layout_of",
    "load_full_state_dict",
    "load_torch_file",
    "read_dcp_metadata",
    "patch_torch",
    "patched_torch",
    "register_extension",
    "register_fsdp_forward_method",
    "replicate",
    "save_dcp",
    "save_full_state_dict",
    "set_collective_bound",
    "set_debug",
    "set_hang_timeout",
    "set_step_checks",
    "share_comm_ctx",
    "subscribe",
    "unpatch_torch",
    "write_state_dict_file",
]
