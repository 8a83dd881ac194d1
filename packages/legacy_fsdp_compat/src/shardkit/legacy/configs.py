"""FSDP1's enums and configuration classes, field for field.

Each class has the fields, defaults and positional order of its namesake in
``torch.distributed.fsdp``, so FSDP1 code that builds them keeps working with the import
changed. They are plain (mutable) dataclasses as FSDP1's are: code that sets a field after
construction keeps working too. The wrapper also accepts torch's own instances (see
:mod:`shardkit.legacy.torch_compat`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn

from shardkit.legacy.torch_compat import BATCH_NORM

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]


class ShardingStrategy(Enum):
    """What FSDP1 shards, and when it frees full parameters (see the package README's table)."""

    FULL_SHARD = auto()
    """Parameters, gradients and optimizer state sharded; full parameters freed after forward."""
    SHARD_GRAD_OP = auto()
    """Sharded, but full parameters are kept from forward to backward (ZeRO-2)."""
    NO_SHARD = auto()
    """Everything replicated, gradients all-reduced (DDP)."""
    HYBRID_SHARD = auto()
    """FULL_SHARD within a shard group, replicated across groups (HSDP)."""
    _HYBRID_SHARD_ZERO2 = auto()
    """SHARD_GRAD_OP within a shard group, replicated across groups."""


class BackwardPrefetch(Enum):
    """When FSDP1 issues the next all-gather in backward (shardkit always prefetches)."""

    BACKWARD_PRE = auto()
    """Before the current group's gradient computation."""
    BACKWARD_POST = auto()
    """After it."""


class StateDictType(Enum):
    """Which form ``state_dict()`` takes under ``FullyShardedDataParallel.state_dict_type``."""

    FULL_STATE_DICT = auto()
    """Full tensors, keyed by parameter names."""
    LOCAL_STATE_DICT = auto()
    """Each FSDP unit's flat-parameter shard (not supported yet)."""
    SHARDED_STATE_DICT = auto()
    """Each parameter's shard: ShardedTensor, or DTensor with a device mesh."""


class OptimStateKeyType(Enum):
    """What keys an optimizer state dict's ``state`` by (``rekey_optim_state_dict``)."""

    PARAM_NAME = auto()
    """Parameter names (FQNs)."""
    PARAM_ID = auto()
    """Integer positions, as ``torch.optim.Optimizer.state_dict()`` has them."""


@dataclass
class MixedPrecision:
    """FSDP1's mixed precision: the dtypes of the full parameters, reductions and buffers."""

    param_dtype: torch.dtype | None = None
    """dtype of the full parameters in forward and backward (the sharded ones keep theirs)."""
    reduce_dtype: torch.dtype | None = None
    """dtype of the gradient reduction; None reduces in ``param_dtype``."""
    buffer_dtype: torch.dtype | None = None
    """dtype that buffers are cast to for training (state dicts give their own dtype back)."""
    keep_low_precision_grads: bool = False
    """Give the optimizer gradients in ``param_dtype`` instead of the parameters' dtype."""
    cast_forward_inputs: bool = False
    """Cast floating-point inputs of every FSDP module's forward to ``param_dtype``."""
    cast_root_forward_inputs: bool = True
    """Cast the root's floating-point forward inputs to ``param_dtype``."""
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (BATCH_NORM,)
    """With an auto-wrap policy, modules of these classes get a group of their own, in full
    precision."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(
                    f"MixedPrecision.{name} must be a torch.dtype or None, got {value!r}"
                )


@dataclass
class CPUOffload:
    """FSDP1's CPU offloading."""

    offload_params: bool = False
    """Keep sharded parameters and gradients on the CPU (the optimizer steps there)."""


@dataclass
class StateDictConfig:
    """What every model state-dict type takes."""

    offload_to_cpu: bool = False
    """Give the values on the CPU."""


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``FULL_STATE_DICT``'s options."""

    rank0_only: bool = False
    """Only rank 0 gets the values; the other ranks get an empty state dict."""


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """``LOCAL_STATE_DICT``'s options (the type itself is not supported yet)."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """``SHARDED_STATE_DICT``'s options."""

    _use_dtensor: bool = False
    """Give DTensors instead of ShardedTensors (always so when a device mesh was given)."""


@dataclass
class OptimStateDictConfig:
    """What every optimizer state-dict type takes."""

    offload_to_cpu: bool = True
    """Give the state tensors on the CPU."""


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Full optimizer state's options."""

    rank0_only: bool = False
    """Only rank 0 gets the state; the other ranks get an empty dict."""


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Local optimizer state's options (not supported yet)."""

    offload_to_cpu: bool = False
    """Give the state tensors on the CPU."""


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Sharded optimizer state's options."""

    _use_dtensor: bool = False
    """Give DTensors instead of ShardedTensors (always so when a device mesh was given)."""


@dataclass
class StateDictSettings:
    """The state-dict type and configs set on a model (what ``set_state_dict_type`` returns)."""

    state_dict_type: StateDictType
    """The model state dict's type."""
    state_dict_config: StateDictConfig
    """Its options."""
    optim_state_dict_config: OptimStateDictConfig
    """The optimizer state dict's options."""
