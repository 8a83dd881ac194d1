"""DCP checkpoints of shardkit models load at another world size and on another mesh shape.

A checkpoint (model and AdamW state, through ``get_state_dict`` and ``dcp.save``) is taken after
2 steps. A fresh model sharded differently loads it: every value must come back exactly, and 3
more steps must give the losses of the saving run that went on without stopping. All runs see
the same global batch per step, so the loss is the same number up to summation order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.ckpt_helpers import load_body, save_body

Values = dict[str, torch.Tensor]


def _layout(spec: str) -> tuple[int, tuple[int, int] | None]:
    """World size and HSDP shape of a spec: "4" is FSDP on 4 ranks, "2x2" is HSDP (2, 2)."""
    if "x" in spec:
        replicate, shard = (int(n) for n in spec.split("x"))
        return replicate * shard, (replicate, shard)
    return int(spec), None


Saver = Callable[[str], dict[str, Any]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saver:
    """Saves a shardkit checkpoint per layout on first use; returns rank 0's saving run."""
    runs: dict[str, dict[str, Any]] = {}

    def save(spec: str) -> dict[str, Any]:
        if spec not in runs:
            world_size, hsdp = _layout(spec)
            path = tmp_path_factory.mktemp(f"ckpt_{spec}")
            results = run_on_ranks(
                world_size, save_body, impl="shardkit", hsdp=hsdp, path=str(path)
            )
            runs[spec] = dict(results[0], path=str(path))
        return runs[spec]

    return save


def _assert_same(loaded: Values, saved: Values, what: str) -> None:
    assert loaded.keys() == saved.keys(), what
    differs = [n for n in saved if not loaded[n].equal(saved[n])]
    assert differs == [], f"{what}: loaded values differ from the saved ones: {differs}"


@pytest.mark.parametrize(
    ("save_spec", "load_spec"),
    [
        pytest.param("2", "1", id="W2-to-W1"),
        pytest.param("2", "3", id="W2-to-W3"),
        pytest.param("2", "4", id="W2-to-W4"),
        pytest.param("3", "2", id="W3-to-W2"),
        pytest.param("4", "2x2", id="FSDP4-to-HSDP2x2"),
        pytest.param("2x2", "4", id="HSDP2x2-to-FSDP4"),
    ],
)
def test_load_at_another_layout(saved: Saver, save_spec: str, load_spec: str) -> None:
    saver = saved(save_spec)
    world_size, hsdp = _layout(load_spec)
    results = run_on_ranks(world_size, load_body, impl="shardkit", hsdp=hsdp, path=saver["path"])
    for rank, result in enumerate(results):
        # Resharding moves bytes: every parameter, buffer and moment comes back exactly.
        _assert_same(result["model"], saver["model"], f"rank {rank}, model")
        _assert_same(result["optim"], saver["optim"], f"rank {rank}, optimizer")
        assert result["param_kinds"] == {"DTensor"}, rank
        assert result["after"] == pytest.approx(saver["after"], rel=1e-5), rank


def test_savers_agree_across_layouts(saved: Saver) -> None:
    """The oracle's premise: every layout trains the same global batch to the same losses."""
    reference = saved("2")
    for spec in ("3", "4", "2x2"):
        run = saved(spec)
        losses = run["before"] + run["after"]
        assert losses == pytest.approx(reference["before"] + reference["after"], rel=1e-5), spec


@pytest.mark.parametrize(
    "impl",
    [
        "torch",
        "shardkit",
    ],
)
def test_resume_after_an_eval_forward(saved: Saver, impl: str) -> None:
    """A job that evaluates before it resumes (at another world size) trains from the load."""
    saver = saved("2")
    results = run_on_ranks(4, load_body, impl=impl, hsdp=None, path=saver["path"], eval_first=True)
    assert results[0]["after"] == pytest.approx(saver["after"], rel=1e-5)
