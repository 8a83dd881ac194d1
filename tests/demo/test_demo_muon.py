"""The demo's trainer with ``--optimizer muon``: Muon on the blocks' matrices, AdamW on the rest.

Two pool ranks train the demo's GPT, narrowed, for 8 steps on each engine: the loss falls,
the two engines give the same losses bit for bit (Muon takes torch's ``fully_shard``
parameters as it takes shardkit's), and the Muon run's losses are not AdamW's (the flag
reaches the step). A checkpoint directory with Muon is refused before any rank starts (the
demo's checkpoint holds one optimizer).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from demo.config import parse_args
from demo.train_gpt import Hooks, train

from harness.pool import run_on_ranks
from tests.demo.in_pool import losses

SMALL = ["--d-model=64", "--n-layers=2", "--seq-len=32", "--batch-size=2", "--steps=8"]


def _train(rank: int, world_size: int, argv: list[str]) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(*parse_args(argv), Hooks())
    return printed.getvalue()


def _losses(tmp_path: Path, *args: str) -> tuple[dict[int, float], str]:
    metrics = tmp_path / f"{'_'.join(a.strip('-') for a in args)}.jsonl"
    out = run_on_ranks(2, _train, argv=[*SMALL, *args, f"--metrics-file={metrics}"])
    return losses(metrics), out[0]


def test_muon_trains_alike_on_both_engines(tmp_path: Path) -> None:
    muon, printed = _losses(tmp_path, "--optimizer=muon")
    assert "optimizer=muon" in printed
    assert sorted(muon) == list(range(1, 9)) and muon[8] < muon[1]
    on_torch, _ = _losses(tmp_path, "--optimizer=muon", "--impl=torch")
    assert on_torch == muon
    adamw, _ = _losses(tmp_path, "--optimizer=adamw")
    assert adamw != muon


def test_muon_refuses_a_checkpoint_directory_yet() -> None:
    with pytest.raises(ValueError, match="--optimizer muon takes no --ckpt-dir yet"):
        parse_args(["--optimizer=muon", "--ckpt-dir=x"])
