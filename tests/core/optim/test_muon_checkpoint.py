"""Muon's state (and AdamW's beside it) through DCP and CheckpointManager, resharded.

Saved at W=2; loaded at W=1, 2, 3 (16-row matrices: uneven blocks) and 4, and under the other
engine, with ``get_state_dict`` / ``set_state_dict`` on fresh optimizers (their state made by
``get_state_dict``'s zero-gradient step, then overwritten). Every value comes back exactly, the
momentum stays a DTensor like the parameter, a single process loads the same checkpoint into
``torch.optim.Muon``, and the two train on bit for bit (see ``muon_ckpt_runs``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.optim.muon_ckpt_runs import (
    RESUMED,
    full_state_body,
    hostile_body,
    resume_body,
    save_body,
)

Saver = Callable[[str, str], dict[str, Any]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saver:
    """A W=2 checkpoint per (engine, way of saving), made on first use; rank 0's values."""
    runs: dict[tuple[str, str], dict[str, Any]] = {}

    def save(impl: str, via: str) -> dict[str, Any]:
        if (impl, via) not in runs:
            path = str(tmp_path_factory.mktemp(f"muon_{impl}_{via}"))
            results = run_on_ranks(2, save_body, impl=impl, path=path, via=via)
            runs[(impl, via)] = dict(results[0], path=path)
        return runs[(impl, via)]

    return save


def _check_resume(saver: dict[str, Any], world_size: int, impl: str, via: str) -> None:
    results = run_on_ranks(world_size, resume_body, impl=impl, path=saver["path"], via=via)
    assert any(k.endswith(".momentum_buffer") for k in saver["optim"])
    assert any(k.endswith(".exp_avg_sq") for k in saver["optim"])
    for rank, result in enumerate(results):
        for part, values in (
            ("model", result["model"]),
            ("optim", result["optim"]),
            ("optim, single process", result["ref_loaded"]),
        ):
            source = saver["model" if part == "model" else "optim"]
            assert values.keys() == source.keys(), (rank, part)
            differs = [k for k, v in source.items() if not torch.equal(values[k], v)]
            assert differs == [], (rank, part, differs)
        assert result["momentum_kinds"] == {"DTensor"}, rank
        assert result["equal"] == [True] * RESUMED, rank


@pytest.mark.parametrize(
    "world_size",
    [
        pytest.param(1, id="W2-to-W1", marks=pytest.mark.slow),
        pytest.param(3, id="W2-to-W3", marks=pytest.mark.slow),
        pytest.param(4, id="W2-to-W4", marks=pytest.mark.slow),
    ],
)
def test_dcp_reshards_muon_state(saved: Saver, world_size: int) -> None:
    _check_resume(saved("shardkit", "dcp"), world_size, "shardkit", "dcp")


@pytest.mark.slow
def test_checkpoint_manager_reshards_muon_state(saved: Saver) -> None:
    _check_resume(saved("shardkit", "manager"), 3, "shardkit", "manager")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saver", "loader"),
    [
        pytest.param("shardkit", "torch", id="shardkit-to-torch"),
        pytest.param("torch", "shardkit", id="torch-to-shardkit"),
    ],
)
def test_muon_state_moves_between_engines(saved: Saver, saver: str, loader: str) -> None:
    # torch's fully_shard and torch's dcp.load read a checkpoint that shardkit's engine wrote,
    # and the other way round; Muon's state is the same DTensors either way.
    _check_resume(saved(saver, "dcp"), 2, loader, "dcp")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saver", "loader", "world_size"),
    [
        pytest.param("shardkit", "torch", 4, id="shardkit-W2-to-torch-W4"),
        pytest.param("torch", "shardkit", 3, id="torch-W2-to-shardkit-W3"),
    ],
)
def test_muon_state_moves_between_engines_and_world_sizes(
    saved: Saver, saver: str, loader: str, world_size: int
) -> None:
    # Both at once: another engine's checkpoint, resharded to another world size (16-row
    # matrices in blocks of 6, 6 and 4 at W=3).
    _check_resume(saved(saver, "dcp"), world_size, loader, "dcp")


@pytest.mark.parametrize("broadcast", [False, True], ids=["every-rank", "broadcast-from-rank0"])
@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_full_state_dicts_load_back_into_sharded_muon(impl: str, broadcast: bool) -> None:
    # get_state_dict(full_state_dict=True) gathers the momentum whole; set_state_dict shards
    # it again before Muon's load_state_dict sees it (which takes DTensors like the params).
    # With broadcast_from_rank0 only rank 0 holds the full state; torch sends each rank its
    # shards of it. One more step on the saving run and on the loaded one then gives the same
    # bits: step counters, both moments, the momentum and the hyperparameters all came back.
    results = run_on_ranks(2, full_state_body, impl=impl, broadcast=broadcast)
    for result in results:
        assert result["kinds"] == {"Tensor"}
        assert result["differ_loaded"] == []
        assert result["differ_after_a_step"] == []


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_muon_state_loaded_from_a_live_full_state_dict_is_its_own(impl: str) -> None:
    # The state dicts as get_state_dict returned them, not copied: torch hands AdamW's live
    # 0-dim "step" tensors on to the loaded optimizer (see full_state_body), so AdamW's side
    # may drift after a step; Muon's matrices and momentum must not, whatever torch does.
    results = run_on_ranks(2, full_state_body, impl=impl, copy=False)
    for result in results:
        assert result["differ_loaded"] == []
        muon_values = [
            k
            for k in result["differ_after_a_step"]
            if k in result["muon_names"] or k.rsplit(".", 1)[0] in result["muon_names"]
        ]
        assert result["muon_names"] and muon_values == []


@pytest.mark.parametrize(
    ("case", "message"),
    [
        # DCP's planner refuses a checkpoint whose tensor does not fit the state dict.
        ("shape", "Size mismatch"),
        # Values DCP reads as they are: Muon's load_state_dict refuses them, on every rank.
        ("nan", "rank 1: Muon: blocks.0.attn.qkv.weight: state 'momentum_buffer' holds NaN"),
    ],
)
def test_a_hostile_checkpoint_is_refused_and_nothing_live_loads(
    tmp_path: Path, case: str, message: str
) -> None:
    results = run_on_ranks(2, hostile_body, path=str(tmp_path), case=case)
    assert results[0]["error"] == results[1]["error"], results
    assert message in results[0]["error"], results[0]["error"]
    assert all(r["same"] for r in results)
