"""User-facing policies: mixed precision, offloading, and the data-parallel axes of a mesh.

These mirror ``torch.distributed.fsdp``'s policies field for field, so code written for torch's
``fully_shard`` passes them unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardkit.core.torch_release import not_in_shardkit

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "MixedPrecisionPolicy", "OffloadPolicy"]


# Positional like torch's dataclasses (``MixedPrecisionPolicy(torch.bfloat16, torch.float32)``
# is valid torch code), hence not kw_only; frozen all the same.
@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Which dtypes parameters, gradients and outputs take during training.

    The sharded parameters (what the optimizer sees) always keep their original dtype.
    Arguments may be positional, in torch's order.
    """

    param_dtype: torch.dtype | None = None
    """dtype of the unsharded parameters: the all-gather and the forward/backward compute."""

    reduce_dtype: torch.dtype | None = None
    """dtype of gradient reduction (reduce-scatter, all-reduce, and no-sync accumulation)."""

    output_dtype: torch.dtype | None = None
    """dtype that floating-point forward outputs are cast to, if set."""

    cast_forward_inputs: bool = True
    """Whether floating-point forward inputs are cast to ``param_dtype``."""

    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = (
        dataclasses.field(default=None, kw_only=True)
    )
    """torch 2.15's per-parameter ``param_dtype``: not implemented, only None is accepted
    (a group's parameters are gathered in one dtype)."""

    def __post_init__(self) -> None:
        if self.param_dtype_override_fn is not None:
            raise not_in_shardkit(
                "MixedPrecisionPolicy(param_dtype_override_fn=...)",
                "2.15",
                "a group's floating-point parameters are all gathered in param_dtype; keep a "
                "parameter in its own dtype by sharding its module in a fully_shard call of "
                "its own with another MixedPrecisionPolicy",
            )
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecisionPolicy.{name} must be a torch.dtype or None")
            if value is not None and not value.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating dtype: {value}")


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass(frozen=True, slots=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU; copy to the device only to gather.

    The optimizer then steps on the CPU.
    """

    pin_memory: bool = True
    """Pin the CPU shards for faster, asynchronous host-to-device copies. On a build without an
    accelerator there is nothing to pin for, and this is ignored rather than failing."""


AxisNames = str | tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class DataParallelMeshDims:
    """Which axes of the whole SPMD mesh are data-parallel: ``fully_shard(..., dp_mesh_dims=)``.

    The mesh passed to ``fully_shard`` is then the whole mesh, and every parameter is already
    a DTensor on it, ``Replicate()`` on these axes. Shard only is FSDP, replicate only is
    DDP-style replication, both is HSDP. Positional arguments work, as with torch's class
    (``DataParallelMeshDims("dp")`` shards on "dp"); torch's own instances are accepted too.
    """

    shard: AxisNames = None
    """The axis name(s) the parameters are sharded on; several are flattened into one axis."""

    replicate: AxisNames = None
    """The axis name(s) the parameters are replicated across; several are flattened too."""

    def __post_init__(self) -> None:
        for field in ("shard", "replicate"):
            value = getattr(self, field)
            if isinstance(value, list):
                value = tuple(value)  # torch's accepts a list: keep the instance hashable
                object.__setattr__(self, field, value)
            names = (value,) if isinstance(value, str) else value
            if names is not None and not (
                isinstance(names, tuple) and all(isinstance(n, str) for n in names)
            ):
                raise TypeError(
                    f"DataParallelMeshDims.{field} must be a mesh axis name, a tuple of names "
                    f"or None, got {value!r}"
                )
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """``shard`` as a tuple of names (empty when None)."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """``replicate`` as a tuple of names (empty when None)."""
        return _names(self.replicate)


def _names(value: AxisNames) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)
