"""ColumnNormSGD: momentum SGD whose step has unit-norm columns; the seam's second rule.

Not Muon, and no less whole-matrix: each column's norm sums over every row, and ``fully_shard``
cuts rows, so no rank can compute it from its block. It shows that the placement, the owners,
the batching and the exchanges of :class:`~shardkit.core.optim.whole_matrix.
WholeMatrixOptimizer` serve any rule: this one is thirty lines of arithmetic, the single
process's own, and gives a single process's bits sharded (tests/core/optim/).

The step, for a matrix W with gradient G and momentum buffer B::

    B <- momentum * B + G
    U <- B / max(||B[:, j]||, eps), column by column
    W <- W - lr * U
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import ParamsT

from shardkit.core.optim.rule import Options, WholeMatrixRule, momentum_state
from shardkit.core.optim.whole_matrix import WholeMatrixOptimizer

__all__ = ["COLUMN_NORM_RULE", "ColumnNormSGD"]


def _prepare(
    param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], options: Options
) -> torch.Tensor:
    del param
    buf = state["momentum_buffer"]
    buf.mul_(options["momentum"]).add_(grad)
    return buf


def _update(matrix: torch.Tensor, options: Options) -> torch.Tensor:
    norms = torch.linalg.vector_norm(matrix, dim=0, keepdim=True)  # (1, n): over all m rows
    return torch.div(matrix, norms.clamp(min=options["eps"]))


def _apply(
    param: torch.Tensor, update: torch.Tensor, options: Options, shape: tuple[int, int]
) -> None:
    del shape
    param.add_(update, alpha=-options["lr"])


COLUMN_NORM_RULE = WholeMatrixRule(
    name="ColumnNormSGD",
    init_state=momentum_state,
    prepare=_prepare,
    update=_update,
    apply=_apply,
    cost=lambda shape: shape[0] * shape[1],
)
"""Column-normalized momentum as a whole-matrix rule (no batched form: one at a time)."""


class ColumnNormSGD(WholeMatrixOptimizer):
    """SGD with momentum whose update has unit-norm columns, on sharded parameters.

    Args:
        params: the matrices (2-D, or 3-D stacks of them) or groups of them.
        lr: learning rate.
        momentum: the momentum factor.
        eps: the least column norm divided by.
        replicated_over: TP's axis, whose ranks hold the same matrices where TP cuts none
            (``WholeMatrixOptimizer``): each updated once across it too.

    Raises:
        ValueError: a negative lr or momentum, or a parameter neither 2-D nor 3-D.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.9,
        eps: float = 1e-8,
        *,
        replicated_over: DeviceMesh | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        defaults: dict[str, Any] = {"lr": lr, "momentum": momentum, "eps": eps}
        super().__init__(params, defaults, rule=COLUMN_NORM_RULE, replicated_over=replicated_over)
