"""Where a group's gradient reduction divides: before, inside or after its collectives.

Data-parallel gradients are a sum over ranks divided by a factor (the ranks that saw different
data, or the user's ``set_gradient_divide_factor``). Where the division happens decides the
bits of the result, the kernels a step launches and what an all-reduce hook is handed, so it is
decided here, in one place, the way torch's ``fully_shard`` decides it:

- fp32 and bf16 have the range to sum first: the collectives divide (``avg``, or a scaled sum
  for a factor of the user's that is not the shard group's size), and nothing else runs. A
  hook sees the divided gradients.
- fp16 could overflow a sum of many ranks: about the square root of the factor (a power of
  two) is divided out before the reduce-scatter and the rest after the hook (fp64 likewise,
  as torch does).
- ``set_force_sum_reduction_for_comms(True)`` (and MTIA devices, which only sum) keeps the
  collectives to plain sums; the division runs after the hook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardkit.core.runtime.reduction import AVG, SUM, Reduction

__all__ = ["Division", "plan_division"]

# Devices whose collectives only sum.
_SUM_ONLY_DEVICES = frozenset({"mtia"})


@dataclass(frozen=True, slots=True)
class Division:
    """The division of one gradient reduction, stage by stage."""

    pre: float
    """Divides the packed gradients before the reduce-scatter (1: nothing runs)."""
    reduce_scatter: Reduction
    all_reduce: Reduction
    """Across replicas (HSDP, replicate)."""
    post: float
    """Divides the reduced shard after the all-reduce hook (1: nothing runs)."""


def plan_division(
    dtype: torch.dtype,
    shard_size: int,
    replicate_size: int,
    *,
    factor: float | None = None,
    force_sum: bool = False,
    device_type: str = "cpu",
) -> Division:
    """Plan the division of ``dtype`` gradients reduced over shard x replicate ranks.

    ``factor`` replaces the product of the two sizes as the divisor.
    """
    force_sum = force_sum or device_type in _SUM_ONLY_DEVICES
    wide = dtype in (torch.float32, torch.bfloat16)
    if wide and not force_sum:
        if factor is None:
            # A mean over one rank is the identity: a plain sum says so and costs nothing.
            if shard_size * replicate_size == 1:
                return Division(1.0, SUM, SUM, 1.0)
            return Division(1.0, AVG, AVG, 1.0)
        # The factor is applied once, in the reduce-scatter; replicas then sum.
        scatter = AVG if factor == shard_size else Reduction.scaled_sum(factor)
        return Division(1.0, scatter, SUM, 1.0)
    divisor = float(shard_size * replicate_size) if factor is None else factor
    if wide:
        return Division(1.0, SUM, SUM, divisor)
    # Any other dtype (fp16, fp64) splits the division as torch does: the power of two before
    # the sum doubles while it still divides the divisor and is under the divisor's rest,
    # about its square root, so that neither the inputs nor the sum leave fp16's range.
    pre = 1.0
    while divisor % pre == 0 and divisor / pre > pre:
        pre *= 2
    return Division(pre, SUM, SUM, divisor / pre)
