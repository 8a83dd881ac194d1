"""Which FSDP2 names each torch release of the tested range has, for the tests that compare.

shardkit has the whole FSDP2 surface of the newest tested torch on every release (a superset
where the installed torch is older). The tests compare shardkit's surface with the installed
torch's, and these tables say which of shardkit's names that torch cannot have yet: a name
listed here that the installed torch lacks while it should have it fails the tests.
"""

from __future__ import annotations

import torch

from shardkit.core.torch_release import release_of

__all__ = ["ADDED_IN", "INSTALLED", "added_under", "torch_has"]

INSTALLED = release_of(torch.__version__) or (0, 0)
"""The installed torch's (major, minor)."""

ADDED_IN: dict[str, tuple[int, int]] = {
    "DataParallelMeshDims": (2, 12),
    "GradientReductionHandle": (2, 15),
    "fully_shard.dp_mesh_dims": (2, 12),
    "MixedPrecisionPolicy.param_dtype_override_fn": (2, 15),
    "FSDPModule.set_symm_mem_for_comm": (2, 12),
    "FSDPModule.reset_iter_state": (2, 13),
    "FSDPModule.set_reduce_scatter_max_input_buffers": (2, 13),
    "FSDPModule.set_reduce_scatter_unused_params": (2, 13),
    "FSDPModule.set_separate_reduce_scatter_group": (2, 13),
    "FSDPModule.finalize_backward": (2, 15),
    "FSDPModule.set_keep_unsharded_storage": (2, 15),
    "FSDPModule.set_manual_backward_finalization": (2, 15),
}
"""The FSDP2 names that came after torch 2.10, each with its release: torch.distributed.fsdp's
names, and (dotted) fully_shard's parameters, the policies' fields and FSDPModule's methods."""


def added_under(prefix: str) -> dict[str, tuple[int, int]]:
    """``ADDED_IN``'s names under ``prefix`` ("FSDPModule"), without the prefix."""
    return {k.split(".", 1)[1]: v for k, v in ADDED_IN.items() if k.startswith(prefix + ".")}


def torch_has(name: str) -> bool:
    """Whether the installed torch's FSDP2 has ``name`` (as ``ADDED_IN`` spells it)."""
    return ADDED_IN.get(name, (0, 0)) <= INSTALLED
