"""The one module of shardkit.legacy that knows torch's FSDP1 objects and private names.

FSDP1 code often mixes imports: the wrapper comes from shardkit.legacy while a config or a
wrap policy still comes from ``torch.distributed.fsdp``. Such objects are translated here, by
name and field, into shardkit.legacy's own. Torch's policy objects decide their targets
through a private method (``_run_policy``), the batch-norm base class FSDP1 keeps in full
precision is private (``_BatchNorm``), and so is the activation-checkpoint wrapper's prefix;
so are the ``torch._foreach_*`` ops that gradient clipping batches (torch's own
``clip_grad_norm_`` uses them). Keeping each use here means a torch upgrade that changes them
breaks one file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    ActivationWrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

__all__ = [
    "BATCH_NORM",
    "CHECKPOINT_PREFIX",
    "FSDP_PREFIX",
    "FSDP_WRAPPED_MODULE",
    "ShardedTensor",
    "checkpoint_inner",
    "clean_name",
    "flat_sharded_tensor",
    "foreach_mul_",
    "foreach_norm",
    "is_torch_policy",
    "map_tensors",
    "renamed_keys",
    "root_mesh",
    "torch_policy_targets",
    "translate",
]

BATCH_NORM: type[nn.Module] = _BatchNorm
"""The base class of torch's batch norms (FSDP1's default modules to keep in full precision)."""

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
"""The attribute under which an FSDP1 wrapper holds its module."""

FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
"""What the wrapper adds to the names of everything under it."""

CHECKPOINT_PREFIX: str = _CHECKPOINT_PREFIX
"""What torch's activation-checkpoint wrapper adds to names."""

_TORCH_FSDP = "torch.distributed.fsdp"


def clean_name(name: str) -> str:
    """``name`` without the wrappers' prefixes: the name FSDP1's state dicts use."""
    return name.replace(FSDP_PREFIX, "").replace(CHECKPOINT_PREFIX, "")


def checkpoint_inner(module: nn.Module) -> nn.Module:
    """The module inside torch's activation-checkpoint wrapper (``module`` if it is none)."""
    if isinstance(module, ActivationWrapper):
        inner = module._checkpoint_wrapped_module
        assert isinstance(inner, nn.Module)
        return inner
    return module


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` (args, kwargs, outputs) with ``fn`` applied to every tensor in it."""
    return pytree.tree_map_only(torch.Tensor, fn, tree)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it was not)."""
    return mesh._get_root_mesh()


def renamed_keys(result: Any, rename: Callable[[str], str]) -> Any:
    """``load_state_dict``'s missing and unexpected keys (a named tuple), renamed."""
    return result._replace(
        missing_keys=[rename(k) for k in result.missing_keys],
        unexpected_keys=[rename(k) for k in result.unexpected_keys],
    )


def flat_sharded_tensor(
    local: torch.Tensor, offset: int, numel: int, rank: int, group: dist.ProcessGroup
) -> ShardedTensor:
    """A 1-D ShardedTensor of ``numel`` elements: ``local`` at ``offset`` on ``rank`` (collective).

    An empty ``local`` contributes no shard, as FSDP1's LOCAL_STATE_DICT has it. Every rank
    of ``group`` calls it (the global metadata is gathered).
    """
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharded_tensor.shard import Shard

    shards = [Shard.from_tensor_and_offsets(local, [offset], rank)] if local.numel() else []
    tensor: ShardedTensor = init_from_local_shards(shards, numel, process_group=group)
    return tensor


def foreach_norm(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's ``norm_type`` norm in float32, in one dispatch."""
    return list(torch._foreach_norm(tensors, norm_type, dtype=torch.float32))


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """Multiply each tensor in place by the 0-dim ``scalar`` (of their device and dtype)."""
    torch._foreach_mul_(tensors, scalar)


def _is_torch_fsdp1(value: object) -> bool:
    return type(value).__module__.startswith(_TORCH_FSDP)


def translate(value: Any, ours: dict[str, type[Any]]) -> Any:
    """Torch's FSDP1 enum member or config as shardkit.legacy's (same name, same fields).

    Anything else (shardkit.legacy's own objects, None) comes back as it is.

    Args:
        value: what the user passed.
        ours: shardkit.legacy's classes by name.
    """
    if not _is_torch_fsdp1(value):
        return value
    cls = ours.get(type(value).__name__)
    if cls is None:
        return value
    if isinstance(value, Enum):
        return cls[value.name]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: translate(getattr(value, f.name), ours) for f in dataclasses.fields(value)
        }
        return cls(**fields)
    return value


def is_torch_policy(policy: object) -> bool:
    """Whether ``policy`` is one of torch's FSDP1 policy objects (ModuleWrapPolicy...)."""
    from torch.distributed.fsdp.wrap import _Policy

    return isinstance(policy, _Policy)


def torch_policy_targets(
    policy: object, root: nn.Module, ignored: set[nn.Module], root_kwargs: dict[str, Any]
) -> dict[nn.Module, dict[str, Any]]:
    """The modules torch's policy object wraps, with the arguments of each wrapper."""
    from torch.distributed.fsdp.wrap import _Policy

    assert isinstance(policy, _Policy)
    targets: dict[nn.Module, dict[str, Any]] = policy._run_policy(root, ignored, root_kwargs)
    return targets


def classes_kept_in_full_precision(mixed_precision: Any) -> tuple[type[nn.Module], ...]:
    """The module classes an FSDP1 ``MixedPrecision`` leaves in full precision.

    Its ``_module_classes_to_ignore`` (BatchNorm by default); each becomes a unit of its own.
    """
    return tuple(getattr(mixed_precision, "_module_classes_to_ignore", ()) or ())


SHARDED_TENSOR_CLASS = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"
"""Where a pickled ShardedTensor names its class."""


def sharded_tensor_pickle_types() -> list[Any]:
    """The classes a pickled ShardedTensor holds besides itself (for ``safe_globals``)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (
        MEM_FORMAT_ENCODING,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.remote_device import _remote_device

    return [
        Shard,
        ShardMetadata,
        ShardedTensorMetadata,
        TensorProperties,
        MEM_FORMAT_ENCODING,
        ChunkShardingSpec,
        _remote_device,
    ]


def process_group_state_type() -> type:
    """``ShardedTensor.ProcessGroupState``, which a ShardedTensor pickle names."""
    state: type = ShardedTensor.ProcessGroupState
    return state


def dcp_fsdp_state_lookup(is_ours: Callable[[nn.Module], bool]) -> Callable[[nn.Module], Any]:
    """DCP's check that a module FSDP1 lists is a fully sharded module, knowing our wrappers.

    torch's DCP state-dict helpers (``get_model_state_dict``...) verify each module that
    ``FSDP.fsdp_modules`` returned through a private lookup of torch's FSDP1 state; under
    ``patch_torch`` they list this package's wrappers, which are their own state here.
    """
    from torch.distributed.fsdp._common_utils import (
        _get_module_fsdp_state_if_fully_sharded_module as torch_lookup,
    )

    def lookup(module: nn.Module) -> Any:
        return module if is_ours(module) else torch_lookup(module)

    return lookup
