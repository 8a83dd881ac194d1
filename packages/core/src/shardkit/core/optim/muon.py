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
    batches_on,
    check_newton_schulz,
    orthogonalize,
    orthogonalize_batch,
)
from shardkit.core.optim.rule import Options, WholeMatrixRule, momentum_state
from shardkit.core.optim.whole_matrix import WholeMatrixOptimizer

__all__ = ["MUON_RULE", "Muon"]

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

# Devices where Muon's elementwise parts run as foreach operators: a few a step (on a GPU, a
# launch each) instead of five a matrix, each tensor with the per-tensor operators' bits. None
# by default. The CPU's foreach operators are its per-tensor kernels in a loop: the same bits
# (tests/core/optim/test_muon_foreach.py), no launches to save, and slower (host-32's blocks at
# W=8 on the fake group, Muon's step alone: 69.2 against 65.8 ms median of 40, each part now
# streaming every matrix where one at a time kept a matrix's rows in cache for all three).
# CUDA's fast foreach kernels are kernels of their own: shut until a check on the device
# (``benchmarks/cuda_muon_run.py parity --foreach``, in ``make check-gpu``'s muon chunk) says
# they keep the bits.
_FOREACH_DEVICES: frozenset[str] = frozenset()


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
    # A tensor lr makes a 0-dim tensor alpha, which add_ takes (torch's Muon passes it too),
    # though torch's stubs say a number.
    param.add_(_laid_out(param, update, shape), alpha=-step)  # type: ignore[arg-type]


def _laid_out(param: torch.Tensor, update: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``update`` in the layout whose ``add_`` kernel torch's Muon meets, for its bits."""
    if update.dtype == param.dtype and shape[0] > shape[1] and update.stride(-1) == 1:
        # torch's Muon adds a tall matrix's update as the transpose Newton-Schulz returns. A
        # CPU add_ of two bf16 tensors takes the vectorized kernel (one fused rounding) only
        # where both are contiguous, else the scalar one (alpha * update rounded first): rows
        # that came back contiguous from the owner are given the transposed layout, so that
        # bf16 parameters take torch's kernel and its bits. (An fp32 parameter casts the bf16
        # update in the scalar kernel whatever the layout.)
        return update.mT.contiguous().mT
    if update.dtype == param.dtype and shape[0] <= shape[1] and not update.is_contiguous():
        # The other way round: torch adds a wide or square matrix's update contiguous, in the
        # vectorized kernel. The owner's own block of a matrix cut by columns (TP's
        # RowwiseParallel) is a slice of the whole update, its rows shorter than a vector:
        # the scalar kernel, one bf16 rounding more, unless copied contiguous.
        return update.contiguous()
    return update


def _foreach_on(tensors: list[torch.Tensor]) -> bool:
    """Whether the foreach path is open where these tensors live (``_FOREACH_DEVICES``)."""
    return bool(tensors) and all(t.device.type in _FOREACH_DEVICES for t in tensors)


def _prepare_all(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    options: Options,
) -> list[torch.Tensor]:
    if not _foreach_on(grads):
        return [_prepare(p, g, s, options) for p, g, s in zip(params, grads, states, strict=True)]
    momentum = options["momentum"]
    bufs = [state["momentum_buffer"] for state in states]
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    updates = list(torch._foreach_lerp(grads, bufs, momentum)) if options["nesterov"] else bufs
    # ``.bfloat16()`` of each, as ``_prepare``: a bf16 one as it is, the others copied (and
    # rounded) in one foreach copy.
    narrow = [u if u.dtype == torch.bfloat16 else torch.empty_like(u, dtype=torch.bfloat16)
              for u in updates]  # fmt: skip
    cast = [i for i, u in enumerate(updates) if u is not narrow[i]]
    if cast:
        torch._foreach_copy_([narrow[i] for i in cast], [updates[i] for i in cast])
    return narrow


def _apply_all(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    options: Options,
    shapes: list[tuple[int, int]],
) -> None:
    lr = options["lr"]
    if isinstance(lr, torch.Tensor) or not _foreach_on(params):
        for param, update, shape in zip(params, updates, shapes, strict=True):
            _apply(param, update, options, shape)
        return
    # The decay as a 0-dim tensor: the CPU's foreach mul by a number rounds a bf16 or fp16
    # tensor's product otherwise than ``mul_`` by the same number (found by the bf16 tests);
    # by a 0-dim float64 tensor it is ``mul_``'s, bit for bit.
    decay = torch.tensor(1 - lr * options["weight_decay"], dtype=torch.float64)
    torch._foreach_mul_(params, decay)
    # One add a learning rate: the adjusted one depends on the matrix's shape.
    by_step: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for param, update, shape in zip(params, updates, shapes, strict=True):
        step = float(adjusted_lr(lr, options["adjust_lr_fn"], shape))
        targets, sources = by_step.setdefault(step, ([], []))
        targets.append(param)
        sources.append(_laid_out(param, update, shape))
    for step, (targets, sources) in by_step.items():
        torch._foreach_add_(targets, sources, alpha=-step)


def _bf16(dtype: torch.dtype) -> torch.dtype:
    del dtype
    return torch.bfloat16  # Newton-Schulz runs and returns bf16, whatever came in


MUON_RULE = WholeMatrixRule(
    name="Muon",
    init_state=momentum_state,
    prepare=_prepare,
    update=_update,
    update_batch=_update_batch,
    batches_on=batches_on,
    update_dtype=_bf16,
    apply=_apply,
    prepare_all=_prepare_all,
    apply_all=_apply_all,
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
