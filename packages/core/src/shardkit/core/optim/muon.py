"""Muon for sharded parameters: ``torch.optim.Muon``'s arguments, defaults and bits.

Muon (Keller Jordan, 2024) steps each weight matrix by the orthogonalized momentum: Newton-
Schulz on the whole matrix, which row blocks cannot compute (torch's Muon on ``fully_shard``'s
DTensors runs it through DTensor's sharded matmuls: collectives inside every iteration on every
rank, and other bits; see docs/guide/muon.md). Here the momentum stays sharded like the
parameter, each matrix is orthogonalized once in the job by its owner, and every rank applies
its rows: the rule below, placed by :class:`~shardkit.core.optim.whole_matrix.
WholeMatrixOptimizer`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import ParamsT

from shardkit.core.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    adjusted_lr,
    check_newton_schulz,
    orthogonalize,
    orthogonalize_batch,
)
from shardkit.core.optim.rule import Options, WholeMatrixRule, momentum_state
from shardkit.core.optim.whole_matrix import WholeMatrixOptimizer

__all__ = ["MUON_RULE", "Muon"]

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def _prepare(
    param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], options: Options
) -> torch.Tensor:
    del param
    momentum = options["momentum"]
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if options["nesterov"] else buf
    # Newton-Schulz's first operation is this cast: elementwise, so the rows may take it, and
    # half the bytes travel to the owner.
    return update.bfloat16()


def _update(matrix: torch.Tensor, options: Options) -> torch.Tensor:
    return orthogonalize(matrix, options["ns_coefficients"], options["ns_steps"], options["eps"])


def _update_batch(matrices: torch.Tensor, options: Options) -> torch.Tensor:
    coefficients, steps, eps = options["ns_coefficients"], options["ns_steps"], options["eps"]
    return orthogonalize_batch(matrices, coefficients, steps, eps)


def _apply(
    param: torch.Tensor, update: torch.Tensor, options: Options, shape: tuple[int, int]
) -> None:
    lr = options["lr"]
    if isinstance(lr, torch.Tensor) and lr.dim() != 0:
        lr = lr.squeeze()  # torch's Muon takes a 1-element tensor as a 0-dim one
    param.mul_(1 - lr * options["weight_decay"])
    step = adjusted_lr(lr, options["adjust_lr_fn"], shape)
    if update.dtype == param.dtype and shape[0] > shape[1] and update.stride(-1) == 1:
        # torch's Muon adds a tall matrix's update as the transpose Newton-Schulz returns. A
        # CPU add_ of two bf16 tensors takes the vectorized kernel (one fused rounding) only
        # where both are contiguous, else the scalar one (alpha * update rounded first): rows
        # that came back contiguous from the owner are given the transposed layout, so that
        # bf16 parameters take torch's kernel and its bits. (An fp32 parameter casts the bf16
        # update in the scalar kernel whatever the layout.)
        update = update.mT.contiguous().mT
    elif update.dtype == param.dtype and shape[0] <= shape[1] and not update.is_contiguous():
        # The other way round: torch adds a wide or square matrix's update contiguous, in the
        # vectorized kernel. The owner's own block of a matrix cut by columns (TP's
        # RowwiseParallel) is a slice of the whole update, its rows shorter than a vector:
        # the scalar kernel, one bf16 rounding more, unless copied contiguous.
        update = update.contiguous()
    # A tensor lr makes a 0-dim tensor alpha, which add_ takes (torch's Muon passes it too),
    # though torch's stubs say a number.
    param.add_(update, alpha=-step)  # type: ignore[arg-type]


def _bf16(dtype: torch.dtype) -> torch.dtype:
    del dtype
    return torch.bfloat16  # Newton-Schulz runs and returns bf16, whatever came in


MUON_RULE = WholeMatrixRule(
    name="Muon",
    init_state=momentum_state,
    prepare=_prepare,
    update=_update,
    update_batch=_update_batch,
    update_dtype=_bf16,
    apply=_apply,
)
"""Muon as a whole-matrix rule: nesterov momentum on rows, Newton-Schulz whole, lr on rows."""


class Muon(WholeMatrixOptimizer):
    """``torch.optim.Muon`` for parameters sharded by ``fully_shard`` (shardkit's or torch's).

    Same arguments, defaults and update as torch 2.13's Muon, bit for bit: a drop-in where the
    parameters are sharded. Give it the 2-D hidden matrices (and MoE expert stacks, 3-D: each
    expert a matrix of its own); embeddings, the head, norms and biases go to
    ``torch.optim.AdamW``, as with torch's Muon::

        matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
        others = [p for p in model.parameters() if all(p is not m for m in matrices)]
        muon = Muon(matrices, lr=0.02)
        adamw = torch.optim.AdamW(others, lr=3e-4)

    Takes plain tensors and the DTensors of FSDP, HSDP, FSDP x TP and ``replicate`` (either
    engine's), rows and columns that need not divide by the ranks; a placement that does not
    cut each matrix into blocks (``Partial``) raises NotImplementedError naming the parameter.

    Args:
        params: the matrices or groups of them (or ``named_parameters()``-style pairs).
        lr: learning rate.
        weight_decay: decoupled weight decay.
        momentum: the momentum factor.
        nesterov: whether Newton-Schulz takes the nesterov momentum.
        ns_coefficients: (a, b, c) of the quintic Newton-Schulz iteration.
        eps: the least norm Newton-Schulz divides by.
        ns_steps: Newton-Schulz iterations (fewer than 100).
        adjust_lr_fn: None or "original" (lr * sqrt(max(1, m/n))), or "match_rms_adamw"
            (lr * 0.2 * sqrt(max(m, n))).
        replicated_over: not torch's: under FSDP x TP, TP's mesh (``mesh["tp"]``), whose
            ranks hold the same values of the matrices no TP style cuts (an MoE's experts and
            routers). Each of those is then orthogonalized once in the job instead of once per
            TP rank; the first step checks that the ranks agree (every rank raises if not).

    Raises:
        ValueError: what torch's Muon refuses (a negative lr, momentum or weight decay, an
            unknown ``adjust_lr_fn``, a parameter neither 2-D nor a 3-D stack), naming the
            parameter.
        NotImplementedError: a parameter whose shards are not blocks of its matrices.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        replicated_over: DeviceMesh | None = None,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults, rule=MUON_RULE, replicated_over=replicated_over)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its options are checked here, on every rank, not at the owner's step.

        Raises:
            ValueError: what :meth:`check_options` refuses.
        """
        self.check_options({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def check_options(self, options: Options) -> None:
        """Refuse what torch's Muon refuses, for a group added or one a state dict loads.

        torch refuses these at its step, and lr, momentum and weight decay at construction.

        Raises:
            ValueError: an unknown ``adjust_lr_fn``, 100 or more ``ns_steps``, not three
                ``ns_coefficients``, or a negative (or NaN) lr, momentum or weight decay.
        """
        if options["adjust_lr_fn"] not in _ADJUST_LR_FNS:
            raise ValueError(
                f"Adjust learning rate function {options['adjust_lr_fn']} is not supported"
            )
        check_newton_schulz(tuple(options["ns_coefficients"]), options["ns_steps"])
        for key in ("lr", "momentum", "weight_decay"):
            if not options[key] >= 0.0:
                raise ValueError(f"{key} should be >= 0 but is: {options[key]}")
