"""FSDP1's MNIST tutorial (demo/fsdp1_mnist.py) with its imports swapped gives FSDP1's losses.

torch's FSDP1 runs the same script in the same worker (same seed, same data, dropout on):
the train and test loss of every epoch must be equal, bit for bit at W=2 (FSDP1 sums two
gradients once, so the engines' reductions cannot differ in rounding).
"""

from __future__ import annotations

from typing import Any

import pytest
from demo.fsdp1_mnist import OPTIMIZERS, Args, fsdp_main

from harness.pool import run_on_ranks

# Learning rates that keep every optimizer in a sensible regime for two short epochs.
LR = {"adadelta": 1.0, "sgd": 0.01, "adam": 1e-3, "adamw": 1e-3, "adagrad": 0.01, "rmsprop": 1e-3}


def _both(rank: int, world_size: int, **fields: Any) -> dict[str, list[float]]:
    return {impl: fsdp_main(Args(impl=impl, **fields)) for impl in ("shardkit", "torch")}


def test_the_tutorial_gives_fsdp1s_epoch_losses() -> None:
    for out in run_on_ranks(2, _both):
        assert out["shardkit"] == out["torch"]
        assert len(out["torch"]) == 4


def test_the_tutorials_manual_wrapping_gives_fsdp1s_epoch_losses() -> None:
    for out in run_on_ranks(2, _both, manual_wrap=True, width=8):
        assert out["shardkit"] == out["torch"]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_optimizer_gives_fsdp1s_losses_with_dropout(optimizer: str) -> None:
    fields: dict[str, Any] = {
        "optimizer": optimizer,
        "lr": LR[optimizer],
        "width": 8,
        "train_size": 128,
    }
    for out in run_on_ranks(2, _both, **fields):
        assert out["shardkit"] == out["torch"], optimizer
