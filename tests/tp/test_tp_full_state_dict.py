"""Full state dicts of 2D and 3D models: streamed files, the generator, and torch's DSD.

The full state dict of a TP model must be the single-process model's (pytorch issue 129206:
wrong ``full_tensor()`` under TP + FSDP2), load when dim 0 does not divide by dp (136228), and
never hang with DCP's ``full_state_dict`` options under FSDP + TP (134095).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from harness.pool import run_on_ranks
from shardkit.core import iter_full_state_dict, load_full_state_dict, save_full_state_dict
from tests.core.ckpt_helpers import model_values
from tests.core.torch_releases import INSTALLED
from tests.tp.tp_ckpt import SAVE_AFTER, adamw, build, train

LAYOUTS = [(2, 2), (1, 2, 2), (2, 1, 2)]


def _trained(layout: tuple[int, ...], seed: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    model, *dp = build("shardkit", layout, seed=seed)
    train(model, adamw(model), range(SAVE_AFTER), (dp[0], dp[1]))
    return model, model_values(model)


def _save_and_load(
    rank: int, world_size: int, layout: tuple[int, ...], path: str
) -> dict[str, Any]:
    model, values = _trained(layout)
    save_full_state_dict(model, path)
    every_rank = dict(iter_full_state_dict(model, rank0_only=False, cpu_offload=True))
    on_coordinator = dict(iter_full_state_dict(model, rank0_only=True, cpu_offload=True))
    fresh, _ = _trained(layout, seed=7)
    load_full_state_dict(fresh, path)
    return {
        "values": values,
        "every_rank": every_rank,
        "on_coordinator": on_coordinator,
        "loaded": model_values(fresh),
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=["2x2", "1x2x2", "2x1x2"])
def test_full_state_dict_file_and_generator(layout: tuple[int, ...], tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    results = run_on_ranks(4, _save_and_load, layout=layout, path=str(path))
    values = results[0]["values"]
    in_file = load_file(str(path))
    assert in_file.keys() == values.keys()
    for name, value in values.items():
        assert torch.equal(in_file[name], value), name
    for rank, result in enumerate(results):
        for name, value in values.items():
            assert torch.equal(result["every_rank"][name], value), (rank, name)
            assert torch.equal(result["loaded"][name], value), (rank, name)
        assert (result["on_coordinator"].keys() == values.keys()) == (rank == 0), rank


def _dsd_full(rank: int, world_size: int, layout: tuple[int, ...]) -> dict[str, Any]:
    model, values = _trained(layout)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    fresh, _ = _trained(layout, seed=7)
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # DSD replaces the values of the dict it is given: give it a copy.
    set_model_state_dict(fresh, dict(full) if rank == 0 else {}, options=broadcast)
    return {"values": values, "full": full, "loaded": model_values(fresh)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=["2x2", "1x2x2", "2x1x2"])
def test_dcp_full_state_dict_options(layout: tuple[int, ...]) -> None:
    if layout == (2, 1, 2) and INSTALLED < (2, 13):
        pytest.skip(
            f"torch {torch.__version__}'s set_model_state_dict(broadcast_from_rank0=True) loads "
            "inp.weight wrongly on a (2, 1, 2) HSDP x TP mesh, under its own fully_shard too"
        )
    for rank, result in enumerate(run_on_ranks(4, _dsd_full, layout=layout)):
        for name, value in result["values"].items():
            if rank == 0:
                assert torch.equal(result["full"][name], value), name
            assert torch.equal(result["loaded"][name], value), (rank, name)
