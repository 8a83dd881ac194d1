"""User-facing policies: mixed precision, offloading, and the data-parallel axes of a mesh.

These mirror ``torch.distributed.fsdp``'s policies field for field, so code written for torch's
``fully_shard`` passes them unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_api as _torch_policies

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "keeps_own_dtype",
    "offload_policy_of",
    "resolved",
]


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
    """Per parameter, as torch 2.15's: called once on each parameter ``fully_shard`` manages
    (before it is sharded); its own dtype keeps that parameter out of ``param_dtype`` (an
    MoE router or a norm gathered and computed in fp32), None or ``param_dtype`` leaves it
    in. It must answer alike on every rank. Inputs are still cast to ``param_dtype``."""

    def __post_init__(self) -> None:
        fn = self.param_dtype_override_fn
        if fn is not None and not callable(fn):
            raise TypeError("MixedPrecisionPolicy.param_dtype_override_fn must be callable")
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecisionPolicy.{name} must be a torch.dtype or None")
            if value is not None and not value.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating dtype: {value}")


def keeps_own_dtype(policy: Any, param: nn.Parameter, fqn: str) -> bool:
    """Whether ``policy``'s ``param_dtype_override_fn`` keeps ``param`` in its own dtype.

    ``policy`` is shardkit's ``MixedPrecisionPolicy`` or torch's (2.15's has the field).

    Raises:
        ValueError: the function returned something other than None, ``param_dtype`` or the
            parameter's own dtype (named with the parameter).
    """
    fn = getattr(policy, "param_dtype_override_fn", None)
    if fn is None:
        return False
    dtype = fn(param)
    if dtype is None:
        return False
    param_dtype = policy.param_dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"MixedPrecisionPolicy.param_dtype_override_fn returned a {type(dtype).__name__} "
            f"for parameter {fqn}; it must return a torch.dtype or None"
        )
    if dtype not in (param_dtype, param.dtype):
        raise ValueError(
            f"MixedPrecisionPolicy.param_dtype_override_fn returned {dtype} for parameter "
            f"{fqn}; it may return None, param_dtype ({param_dtype}) or the parameter's own "
            f"dtype ({param.dtype})"
        )
    return bool(dtype != param_dtype)


def resolved(policy: Any, own_dtype: torch.dtype | None = None) -> Any:
    """``policy`` with its ``param_dtype_override_fn`` applied, as torch 2.15 resolves it.

    The function is dropped (the state's policy, and each parameter's), and ``param_dtype``
    becomes ``own_dtype`` where given (a parameter the function kept in its own dtype).
    A policy without the function is returned as is.
    """
    if getattr(policy, "param_dtype_override_fn", None) is None:
        return policy
    param_dtype = own_dtype if own_dtype is not None else policy.param_dtype
    return dataclasses.replace(policy, param_dtype=param_dtype, param_dtype_override_fn=None)


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


def offload_policy_of(policy: object) -> OffloadPolicy:
    """``fully_shard``'s ``offload_policy`` as shardkit's class.

    Code written for torch's ``fully_shard`` passes torch's own ``CPUOffloadPolicy`` (the
    import of ``fully_shard`` swapped, the policy's kept): it offloads as shardkit's does.
    torch's classes are read from the module that defines them, which ``patch_torch`` leaves.

    Raises:
        TypeError: ``policy`` is no offload policy of either library's.
    """
    if isinstance(policy, OffloadPolicy):
        return policy
    if isinstance(policy, _torch_policies.CPUOffloadPolicy):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if isinstance(policy, _torch_policies.OffloadPolicy):
        return OffloadPolicy()
    raise TypeError(
        "fully_shard: offload_policy must be an OffloadPolicy or CPUOffloadPolicy (shardkit's "
        f"or torch's), not {type(policy).__name__}"
    )


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
