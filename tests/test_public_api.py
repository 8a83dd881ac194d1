"""The public API of every package, as a snapshot: changing it is a deliberate act."""

from __future__ import annotations

import importlib
import inspect

import pytest

from tests.core.torch_releases import added_under, torch_has

EXPECTED = {
    "shardkit.core": [
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
        "InvalidPlacementError",
        "InvalidShardDimError",
        "LayoutCache",
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
        "patch_torch",
        "patched_torch",
        "read_dcp_metadata",
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
    ],
    "shardkit.core.extensions": [
        "DataParallelSharding",
        "ENTRY_POINT_GROUP",
        "ParamShardingSpec",
        "ShardingExtension",
        "SpmdMeshAxes",
        "SpmdShardingExtension",
        "extension_for",
        "make_dtensor",
        "register_extension",
        "registered_extensions",
    ],
    "shardkit.core.layout": [
        "ALIGN_BYTES",
        "GroupLayout",
        "GroupView",
        "HookInput",
        "ParamLayout",
        "ParamSpec",
        "STEP_CHECK_HEADER_BYTES",
        "ShardGeometry",
        "ShardedParamView",
        "group_layout",
        "keeps_own_dtype",
        "layout_of",
        "pooled_sizes",
        "step_checks_on",
        "wire_row_bytes",
    ],
    "shardkit.core.optim": [
        "COLUMN_NORM_RULE",
        "ColumnNormSGD",
        "MUON_RULE",
        "Muon",
        "MuonWithAdamW",
        "Options",
        "ParamSplit",
        "ShardedMatrixError",
        "StepStats",
        "USE_MUON",
        "WholeMatrixOptimizer",
        "WholeMatrixRule",
        "split_matrices",
    ],
    "shardkit.tp": [
        "DTensorExtensions",
        "DTensorMetadata",
        "TensorParallelSharding",
        "__version__",
        "spmd_mesh",
    ],
    "shardkit.legacy": [
        "BackwardPrefetch",
        "CPUOffload",
        "CheckpointError",
        "ConversionResult",
        "CustomPolicy",
        "FSDP",
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
    ],
    "shardkit.tools": [
        "AxisComm",
        "Category",
        "CollectiveCall",
        "CollectivePlan",
        "CollectiveRecord",
        "CommSummary",
        "CommTracker",
        "GroupPlan",
        "MemoryPlan",
        "MemoryPoint",
        "MemoryReport",
        "MemorySample",
        "MemoryTracker",
        "ModulePeak",
        "ModuleScope",
        "OpCounter",
        "Phase",
        "PhaseSpan",
        "Plan",
        "PlanOptions",
        "PlannedGroup",
        "Profiler",
        "RankReport",
        "StepComm",
        "__version__",
        "apply_plan",
        "load_merged_report",
        "load_rank_reports",
        "plan",
        "summarize",
        "write_rank_report",
        "write_report",
    ],
}


@pytest.mark.parametrize("module", list(EXPECTED))
def test_all_is_the_snapshot(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(EXPECTED[module])
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} listed in __all__ but missing"


def test_drop_in_for_torch_fully_shard() -> None:
    """Every name and keyword of torch.distributed.fsdp's FSDP2 API that we promise exists."""
    import torch.distributed.fsdp as torch_fsdp

    import shardkit.core as ours

    for name in [
        "fully_shard",
        "FSDPModule",
        "UnshardHandle",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "register_fsdp_forward_method",
    ]:
        assert hasattr(ours, name), name
    # torch's parameters and fields, then any a newer torch added (shardkit has those of the
    # newest tested torch on every release).
    theirs_params = list(inspect.signature(torch_fsdp.fully_shard).parameters)
    ours_params = list(inspect.signature(ours.fully_shard).parameters)
    assert ours_params[: len(theirs_params)] == theirs_params
    assert set(ours_params[len(theirs_params) :]) <= set(added_under("fully_shard"))
    for policy in ["MixedPrecisionPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]:
        if not torch_has(policy):
            continue
        their_fields = set(getattr(torch_fsdp, policy).__dataclass_fields__)
        our_fields = set(getattr(ours, policy).__dataclass_fields__)
        assert their_fields <= our_fields
        assert our_fields - their_fields <= set(added_under(policy)), policy
    methods = [
        "unshard", "reshard", "reset_iter_state", "set_is_last_backward",
        "set_requires_gradient_sync", "set_requires_all_reduce", "set_reshard_after_forward",
        "set_reshard_after_backward", "set_modules_to_forward_prefetch",
        "set_modules_to_backward_prefetch", "set_gradient_divide_factor",
        "set_reduce_scatter_divide_factor", "set_force_sum_reduction_for_comms",
        "set_unshard_in_backward", "set_post_optim_event", "set_reduce_scatter_unused_params",
        "set_reduce_scatter_max_input_buffers", "set_separate_reduce_scatter_group",
        "set_all_reduce_hook", "set_custom_all_gather", "set_custom_reduce_scatter",
        "set_allocate_memory_from_process_group_for_comm", "set_symm_mem_for_comm",
        "finalize_backward", "set_keep_unsharded_storage", "set_manual_backward_finalization",
    ]  # fmt: skip
    for method in methods:
        assert hasattr(ours.FSDPModule, method), method
        assert hasattr(torch_fsdp.FSDPModule, method) == torch_has(f"FSDPModule.{method}")
