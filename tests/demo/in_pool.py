"""The demo's own training function on the test pool's ranks, for the demo tests' references.

A 4-rank ``torchrun`` launch costs the suite about 10 s on two cores (an agent and four
processes importing torch); the pool's workers are already running. The tests launch the run
they are about through ``torchrun`` and compute what it is compared with here: the same
training function, mesh and data, so the losses are the same bits.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from demo.config import parse_args
from demo.train_gpt import Hooks, train

from harness.pool import run_on_ranks

__all__ = ["losses", "train_in_pool"]


def losses(metrics: Path) -> dict[int, float]:
    """Each step's loss in a ``--metrics-file``."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in records if "loss" in r}


def _train(rank: int, world_size: int, argv: list[str]) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(*parse_args(argv), Hooks())
    return printed.getvalue()


def train_in_pool(argv: list[str], metrics: Path) -> tuple[dict[int, float], str]:
    """Train demo/train_gpt.py's ``argv`` on 4 pool ranks: its losses and what rank 0 printed."""
    outputs = run_on_ranks(4, _train, argv=[*argv, f"--metrics-file={metrics}"])
    return losses(metrics), outputs[0]
