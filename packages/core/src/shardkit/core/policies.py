"""User-facing policies: mixed precision and offloading.

These mirror ``torch.distributed.fsdp``'s policies field for field, so code written for torch's
``fully_shard`` passes them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecisionPolicy:
    """Which dtypes parameters, gradients and outputs take during training.

    The sharded parameters (what the optimizer sees) always keep their original dtype.
    """

    param_dtype: torch.dtype | None = None
    """dtype of the unsharded parameters: the all-gather and the forward/backward compute."""

    reduce_dtype: torch.dtype | None = None
    """dtype of gradient reduction (reduce-scatter, all-reduce, and no-sync accumulation)."""

    output_dtype: torch.dtype | None = None
    """dtype that floating-point forward outputs are cast to, if set."""

    cast_forward_inputs: bool = True
    """Whether floating-point forward inputs are cast to ``param_dtype``."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecisionPolicy.{name} must be a torch.dtype or None")
            if value is not None and not value.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating dtype: {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU; copy to the device only to gather.

    The optimizer then steps on the CPU.
    """

    pin_memory: bool = True
    """Pin the CPU shards for faster, asynchronous host-to-device copies. On a build without an
    accelerator there is nothing to pin for, and this is ignored rather than failing."""
