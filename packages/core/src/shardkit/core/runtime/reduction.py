"""How a reducing collective combines the ranks' values: a sum, a mean, or a scaled sum.

The mean (``avg``) and the scaled sum (``premul_sum``: each rank's value times ``1 / divisor``,
then summed) fold a gradient's division into the collective itself: NCCL does it inside the
reduction kernel, so a step launches no separate division per group. Backends that cannot
(gloo has no scaled sum; a shard group of one rank has no collective at all) get the same
result from :meth:`Reduction.finish_sum` on the plain sum, which divides afterwards.

Which operation each stage of a gradient reduction uses is the engine's choice
(``engine/reduce/division.py``). The type lives here, below the engine, because the runtime
takes it: ``CollectiveRuntime``'s reduce-scatter and all-reduce are typed with it, and the
runtime's handles finish gloo's and one rank's plain sums with it; the runtime imports
nothing from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

__all__ = ["AVG", "SUM", "Reduction"]


@dataclass(frozen=True, slots=True)
class Reduction:
    """One reducing collective's operation."""

    kind: Literal["sum", "avg", "premul_sum"]
    divisor: float = 1.0
    """``premul_sum`` only: each rank's value is multiplied by ``1 / divisor`` before the sum."""

    @staticmethod
    def scaled_sum(divisor: float) -> Reduction:
        """The sum of each rank's value divided by ``divisor``."""
        if not divisor > 0:
            raise ValueError(f"a scaled sum needs a positive divisor, got {divisor}")
        return Reduction("premul_sum", float(divisor))

    def torch_op(self) -> dist.ReduceOp | dist.ReduceOp.RedOpType:
        """This operation as torch.distributed's collectives take it."""
        if self.kind == "sum":
            return dist.ReduceOp.SUM
        if self.kind == "avg":
            return dist.ReduceOp.AVG
        return _premul_sum(1 / self.divisor)

    def finish_sum(self, summed: torch.Tensor, size: int) -> None:
        """Turn ``summed``, the plain sum over ``size`` ranks, into this operation's result."""
        if self.kind == "avg" and size != 1:
            summed.div_(size)
        elif self.kind == "premul_sum" and self.divisor != 1:
            summed.div_(self.divisor)


SUM = Reduction("sum")
AVG = Reduction("avg")


def _premul_sum(scale: float) -> dist.ReduceOp:
    # torch 2.13 made ReduceOp.PREMUL_SUM callable with the scale; before, the op came from a
    # private factory under another name. Feature-detected, since the enum member exists in both.
    member = dist.ReduceOp.PREMUL_SUM
    if callable(member):
        op: dist.ReduceOp = member(scale)
        return op
    make = getattr(dist, "_make_nccl_premul_sum", None)
    if make is None:
        raise NotImplementedError(
            "this torch has no scaled-sum reduction (ReduceOp.PREMUL_SUM); "
            "set_force_sum_reduction_for_comms(True) divides after a plain sum instead"
        )
    made: dist.ReduceOp = make(scale)
    return made
