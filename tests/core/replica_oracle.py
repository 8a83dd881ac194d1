"""The oracle for programs that are not SPMD: unsharded replicas, one per rank, in one process.

Each rank of a sharded run trains on its own batches with its own control flow. The oracle
builds the same model (same seed) once per rank, in the process that checks, runs each rank's
forward and backward on that rank's batch, and steps every replica with the mean over ranks of
each rank's own gradient (a parameter a rank did not use counts as zeros there; one no rank
used keeps ``grad`` None), which is what data parallel training computes. Every rank of the
sharded run can compute it alone (the batches come from seeds), so a test compares on the rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["OracleStep", "oracle_train"]

OracleStep = Callable[[nn.Module, int, int], torch.Tensor]
"""``(model, rank, step) -> loss``: rank ``rank``'s forward of step ``step`` on ``model``."""


def oracle_train(
    make_model: Callable[[], nn.Module],
    step_fn: OracleStep,
    *,
    world_size: int,
    steps: int,
    lr: float,
    divisor: Sequence[float] | None = None,
) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """Train unsharded replicas with SGD; returns (first step's gradients, final parameters).

    ``divisor``: per step, what the summed gradient is divided by (default: ``world_size``).
    """
    model = make_model()
    first: dict[str, torch.Tensor | None] = {}
    for step in range(steps):
        summed: dict[str, torch.Tensor | None] = {n: None for n, _ in model.named_parameters()}
        for rank in range(world_size):
            model.zero_grad(set_to_none=True)
            loss = step_fn(model, rank, step)
            if loss.requires_grad:
                loss.backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    prev = summed[name]
                    summed[name] = p.grad.clone() if prev is None else prev + p.grad
        div = float(world_size if divisor is None else divisor[step])
        mean = {n: None if g is None else g / div for n, g in summed.items()}
        if step == 0:
            first = dict(mean)
        with torch.no_grad():
            for name, p in model.named_parameters():
                grad = mean[name]
                if grad is not None:
                    p.sub_(lr * grad)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return first, params


def plain(values: dict[str, Any]) -> dict[str, Any]:
    """Full tensors of DTensors (or None), for comparing with the oracle."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for name, v in values.items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[name] = None if v is None else v.detach().clone()
    return out
