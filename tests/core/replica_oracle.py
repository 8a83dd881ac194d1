"""The oracle for programs that are not SPMD: unsharded replicas, one per rank, in one process.

Each rank of a sharded run trains on its own batches with its own control flow: it may skip
modules, leave experts without tokens, or run out of batches early (torch's ``Join``). The
oracle builds the model once (same seed), runs each rank's forward and backward on that rank's
batch in turn, and steps the model with what data parallel training computes: each optimizer
step's gradient is, over its micro-batches, the sum over the ranks that had a batch of each
rank's own gradient, divided by the world size (or by the number of those ranks). A parameter
a rank did not use counts as zeros there; one that no rank used in a step keeps ``grad`` None,
so the optimizer skips it. Every rank of the sharded run can compute it alone (the batches
follow from seeds), so a test compares on the rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Grads", "ReplicaRun", "ReplicaTraining", "Turn", "plain", "sgd", "train_replicas"]

Grads = dict[str, torch.Tensor | None]
"""Gradients by parameter name; None where the parameter has none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """One rank's forward and backward on one micro-batch."""

    rank: int
    """The rank whose batch and control flow this is."""
    step: int
    """The optimizer step the micro-batch belongs to."""
    micro: int
    """The micro-batch within the step (0 without accumulation)."""
    iteration: int
    """The training loop's iteration: ``step * micro_batches + micro``."""


Loss = Callable[[nn.Module, Turn], torch.Tensor | None]
"""``(model, turn) -> loss``: the turn's forward on ``model``; None where the rank has no batch
then (a rank out of batches under ``Join``: it adds no gradient and, with
``divide_by_active_ranks``, does not count)."""


def sgd(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """Plain SGD on every parameter of the model, the optimizer of most tests."""
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaTraining:
    """What the replicas train on, and how each step's gradient is used."""

    make_model: Callable[[], nn.Module]
    """Builds the model as every rank of the sharded run does (seeded)."""
    loss: Loss
    """Each turn's loss."""
    world_size: int
    """The ranks of the sharded run."""
    steps: int
    """Optimizer steps."""
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    """Builds the optimizer on the unsharded model (``sgd(lr)``, or the test's own)."""
    micro_batches: int = 1
    """Micro-batches a step: gradient accumulation over that many iterations."""
    divide_by_active_ranks: bool = False
    """Divide an iteration's summed gradient by the ranks that had a batch in it, not by the
    world size (``Join``'s ``divide_by_initial_world_size=False``)."""
    scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None
    """Builds a learning-rate scheduler, stepped after every optimizer step."""
    before_step: Callable[[nn.Module, int], bool] | None = None
    """``(model, step) -> whether to step``: runs on the averaged gradients, already in
    ``grad`` (clipping them, as a training loop does), before the optimizer."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.steps < 0 or self.micro_batches < 1:
            raise ValueError(f"no training to run: {self}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaRun:
    """What the replicas trained to."""

    grads: list[Grads]
    """Each step's averaged gradient by parameter name, before ``before_step``; None where
    no rank used the parameter in that step."""
    params: dict[str, torch.Tensor]
    """Every parameter after the last step."""
    model: nn.Module
    """The trained model (to run the forwards of an evaluation on)."""
    optimizer: torch.optim.Optimizer
    """The optimizer, as the last step left it (a recording optimizer's record)."""


def train_replicas(training: ReplicaTraining) -> ReplicaRun:
    """Train the unsharded replicas; see the module's docstring for what each step computes."""
    model = training.make_model()
    optimizer = training.optimizer(model)
    scheduler = None if training.scheduler is None else training.scheduler(optimizer)
    grads: list[Grads] = []
    for step in range(training.steps):
        mean = _step_gradient(training, model, step)
        grads.append(mean)
        for name, p in model.named_parameters():
            grad = mean[name]
            p.grad = None if grad is None else grad.clone()  # before_step may clip in place
        if training.before_step is None or training.before_step(model, step):
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ReplicaRun(grads=grads, params=params, model=model, optimizer=optimizer)


def _step_gradient(training: ReplicaTraining, model: nn.Module, step: int) -> Grads:
    """One step's gradient: over its micro-batches, each iteration's sum over the ranks with a
    batch, divided by the world size or by those ranks' number."""
    names = [n for n, _ in model.named_parameters()]
    total: Grads = dict.fromkeys(names)
    for micro in range(training.micro_batches):
        iteration = step * training.micro_batches + micro
        summed: Grads = dict.fromkeys(names)
        active = 0
        for rank in range(training.world_size):
            model.zero_grad(set_to_none=True)
            loss = training.loss(
                model, Turn(rank=rank, step=step, micro=micro, iteration=iteration)
            )
            if loss is None:
                continue
            active += 1
            if loss.requires_grad:
                loss.backward()
            _accumulate(summed, {n: p.grad for n, p in model.named_parameters()})
        divisor = active if training.divide_by_active_ranks else training.world_size
        _accumulate(total, {n: None if g is None else g / divisor for n, g in summed.items()})
    return total


def _accumulate(into: Grads, grads: Grads) -> None:
    """Add ``grads`` into ``into``; a None in either side counts as zeros."""
    for name, grad in grads.items():
        if grad is not None:
            prev = into[name]
            into[name] = grad.clone() if prev is None else prev + grad


def plain(values: dict[str, Any]) -> dict[str, Any]:
    """Full tensors of DTensors (or None), for comparing with the oracle."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for name, v in values.items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[name] = None if v is None else v.detach().clone()
    return out
