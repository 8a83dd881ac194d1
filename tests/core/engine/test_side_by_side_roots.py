"""Two fully_shard roots in one process, each with its own optimizer, trained side by side.

Each model must train exactly as it does alone, and as torch's fully_shard trains it. The
hard case is one root's forward while the other's optimizer is inside its step (two models
trained by two threads, or ranks as threads): a torch-function mode makes it happen at a
fixed point, the first state the stepping optimizer creates, in one thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from harness.pool import run_on_ranks
from tests.core import models, parity

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}
_STEPS = 3


class _MidStep(TorchFunctionMode):
    """Runs ``callback`` once, at the first new optimizer state (zeros_like or clone)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        super().__init__()
        self.callback: Callable[[], None] | None = callback

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.callback is not None and func in (torch.zeros_like, torch.clone):
            callback, self.callback = self.callback, None
            # As another thread would: with its own grad mode (the step runs under no_grad),
            # and this mode is off inside its own handler.
            with torch.enable_grad():
                callback()
        return func(*args, **(kwargs or {}))


class _Trainee:
    """One model, its optimizer and its data."""

    def __init__(self, impl: str, name: str, optimizer: str, world_size: int) -> None:
        self.impl, self.name = impl, name
        self.model = models.build(name)
        run = parity.Run(model=name, impls=(impl,))
        parity.apply(impl, self.model, parity.make_mesh(run, world_size), run)
        cls, kwargs = OPTIMIZERS[optimizer]
        self.opt = cls(self.model.parameters(), **kwargs)
        self.losses: list[float] = []

    def forward_backward(self, step: int, rank: int, world_size: int) -> None:
        x, y = parity.rank_batch(self.name, step, rank, world_size, self.impl)
        loss = models.loss_of(self.name, self.model(x), y)
        loss.backward()
        self.losses.append(parity.global_loss(loss, self.impl, world_size))

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def trace(self) -> dict[str, Any]:
        return {"losses": self.losses, "params": parity.full_params(self.model)}


def _train(rank: int, world_size: int, impl: str, opts: tuple[str, str], together: bool) -> Any:
    a = _Trainee(impl, "gpt", opts[0], world_size)
    b = _Trainee(impl, "mlp", opts[1], world_size)
    for step in range(_STEPS):
        if not together:
            break
        a.forward_backward(step, rank, world_size)
        # b's forward and backward run while a's optimizer is inside its step.
        with _MidStep(functools.partial(b.forward_backward, step, rank, world_size)):
            a.step()
        if len(b.losses) == step:  # the optimizer made no new state this step
            b.forward_backward(step, rank, world_size)
        b.step()
    if not together:
        for trainee in (a, b):
            for step in range(_STEPS):
                trainee.forward_backward(step, rank, world_size)
                trainee.step()
    return {"a": a.trace(), "b": b.trace()}


def _body(rank: int, world_size: int, opts: tuple[str, str]) -> dict[str, Any]:
    return {
        "together": _train(rank, world_size, "shardkit", opts, together=True),
        "alone": _train(rank, world_size, "shardkit", opts, together=False),
        "torch": _train(rank, world_size, "torch", opts, together=True),
    }


@pytest.mark.parametrize("opts", [("adamw", "sgd"), ("adam", "adamw"), ("sgd", "adam")])
@pytest.mark.parametrize("world_size", [1, 2])
def test_each_root_trains_as_alone_and_as_torch(world_size: int, opts: tuple[str, str]) -> None:
    for result in run_on_ranks(world_size, _body, opts=opts):
        for model in ("a", "b"):
            ours = result["together"][model]
            for other in ("alone", "torch"):
                theirs = result[other][model]
                assert ours["losses"] == theirs["losses"], (model, other)
                for name, value in theirs["params"].items():
                    assert torch.equal(ours["params"][name], value), (model, other, name)
