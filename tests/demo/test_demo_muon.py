"""The demo's trainer with ``--optimizer muon``: Muon on the blocks' matrices, AdamW on the rest.

Two pool ranks train the demo's GPT, narrowed, for 8 steps on each engine: the loss falls,
the two engines give the same losses bit for bit (Muon takes torch's ``fully_shard``
parameters as it takes shardkit's), and the Muon run's losses are not AdamW's (the flag
reaches the step). With ``--ckpt-dir`` both optimizers' states go through the checkpoint
(DCP, ``CheckpointManager``): a run stopped at step 4 and resumed gives the losses of the run
that went on, bit for bit.
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
    name = "_".join(a.strip("-").split("/")[-1] for a in args)  # a path's last part only
    metrics = tmp_path / f"{name}.jsonl"
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


def test_muon_resumes_from_a_checkpoint_as_the_run_that_went_on(tmp_path: Path) -> None:
    ckpt = f"--ckpt-dir={tmp_path / 'ckpt'}"
    for run in ("through", "first", "resumed"):
        (tmp_path / run).mkdir()
    through, _ = _losses(tmp_path / "through", "--optimizer=muon")
    first, _ = _losses(tmp_path / "first", "--optimizer=muon", ckpt, "--ckpt-every=2", "--steps=4")
    resumed, printed = _losses(tmp_path / "resumed", "--optimizer=muon", ckpt, "--resume")
    assert "resumed from" in printed and "at step 4" in printed
    assert first == {s: through[s] for s in range(1, 5)}
    assert resumed == {s: through[s] for s in range(5, 9)}


def test_muon_refuses_the_gradient_log() -> None:
    with pytest.raises(ValueError, match="--optimizer muon takes no --snapshot-log"):
        snapshots = ["--snapshot-every=1", "--snapshot-replicate-every=2", "--snapshot-log"]
        parse_args(["--optimizer=muon", "--ckpt-dir=x", *snapshots])
