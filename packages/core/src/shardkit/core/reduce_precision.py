"""How a group's gradients travel and are summed: ``ReducePrecision``, shardkit's own policy.

torch's ``fully_shard`` reduces gradients in ``reduce_dtype`` end to end: with bfloat16, a ring
rounds the partial sum at each of its W-1 hops, and the error grows with the world size. Here
each rank's rows travel in a narrower format and the owner of a shard adds the W contributions
in float32, once (``engine/reduce/precision.py``): the bytes of the narrow format, the rounding
of one cast. Set with ``FSDPModule.set_reduce_precision``; without it, nothing changes.
See [Note: precision-aware reduction].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["ReducePrecision"]

_WIRE_NAMES = ("bfloat16", "int8", "float8_e4m3fn")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReducePrecision:
    """How a group's gradient reductions travel on the wire and are summed (opt-in).

    ``ReducePrecision(wire_dtype=torch.bfloat16)`` sends bfloat16 and sums in float32;
    ``ReducePrecision(wire_dtype=torch.int8, block_size=256, error_feedback=True)`` sends int8
    with a float32 scale per block of 256, and carries each rank's quantization error into its
    next step.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a wire dtype that is not supported, or one the installed torch lacks;
            stochastic rounding of float8; a block size or check setting out of range.
    """

    wire_dtype: torch.dtype | str | None = None
    """bfloat16, int8 or float8_e4m3fn (a torch dtype or its name); None reduces as torch
    does, in ``reduce_dtype``."""
    stochastic_rounding: bool = False
    """Round the cast stochastically (bfloat16, int8): unbiased, reproducible from ``seed``."""
    seed: int = 0
    """Seeds the stochastic rounding (with the rank and the group): the same run, the same
    bits."""
    block_size: int = 256
    """Elements sharing one float32 scale (int8, float8)."""
    error_feedback: bool = False
    """Keep what the quantization dropped from each row this rank sends, and add it to the
    row of the next reduction (a float32 copy of the group's gradients, per rank)."""
    check_every: int = 0
    """Every this many reductions of a group, also reduce exactly (float32) and compare: 0
    never. A check costs one float32 reduction of the group."""
    check_tolerance: float = 1e-2
    """The relative error (over the whole group's reduced gradient, every rank's shard) past
    which a check warns, or raises."""
    check_action: Literal["warn", "raise"] = "warn"
    """What a check past its tolerance does: log a warning, or raise on every rank."""

    def __post_init__(self) -> None:
        wire = self.wire_dtype
        if isinstance(wire, str):
            name = wire.removeprefix("torch.")
            if name not in _WIRE_NAMES:
                raise ValueError(
                    f"ReducePrecision.wire_dtype must be one of {_WIRE_NAMES}, got {wire!r}"
                )
            resolved = getattr(torch, name, None)
            if resolved is None:
                raise ValueError(
                    f"ReducePrecision.wire_dtype={wire!r}: this torch ({torch.__version__}) "
                    "has no such dtype"
                )
            object.__setattr__(self, "wire_dtype", resolved)
            wire = resolved
        if wire is not None and not isinstance(wire, torch.dtype):
            raise TypeError("ReducePrecision.wire_dtype must be a torch.dtype, a name or None")
        if wire is not None and str(wire).removeprefix("torch.") not in _WIRE_NAMES:
            raise ValueError(f"ReducePrecision.wire_dtype must be one of {_WIRE_NAMES}, got {wire}")
        for name in ("stochastic_rounding", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ReducePrecision.{name} must be a bool")
        for name in ("seed", "block_size", "check_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ReducePrecision.{name} must be an int")
        if self.block_size < 1:
            raise ValueError(f"ReducePrecision.block_size must be positive: {self.block_size}")
        if self.check_every < 0:
            raise ValueError(f"ReducePrecision.check_every must be >= 0: {self.check_every}")
        if not self.check_tolerance > 0:
            raise ValueError("ReducePrecision.check_tolerance must be positive")
        if self.check_action not in ("warn", "raise"):
            raise ValueError("ReducePrecision.check_action must be 'warn' or 'raise'")
        if wire is None and (self.stochastic_rounding or self.error_feedback):
            raise ValueError(
                "ReducePrecision: stochastic_rounding and error_feedback need a wire_dtype"
            )
        if self.stochastic_rounding and wire not in (torch.bfloat16, torch.int8):
            raise ValueError(
                f"ReducePrecision: stochastic rounding is for bfloat16 and int8, not {wire}"
            )

    @property
    def compresses(self) -> bool:
        """Whether reductions take the wire path (a wire dtype is set)."""
        return self.wire_dtype is not None
