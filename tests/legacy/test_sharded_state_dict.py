"""SHARDED_STATE_DICT: FSDP1's ShardedTensors and DTensors, through DCP both ways, resharded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from harness.pool import run_on_ranks
from tests.legacy.ckpt_support import (
    assert_same_form,
    forms_after_training,
    fresh,
    load_into,
    plain_sgd,
    state_dict_of,
    train_steps,
)
from tests.legacy.legacy_parity import LegacyRun, full_params, wrap_model


def _form_body(rank: int, world_size: int, run: LegacyRun) -> dict[str, Any]:
    return forms_after_training(run, "SHARDED_STATE_DICT")


@pytest.mark.parametrize(
    ("world_size", "run"),
    [
        (2, LegacyRun(model="gpt")),
        (4, LegacyRun(strategy="SHARD_GRAD_OP")),  # head: 3 rows over 4 ranks
        (4, LegacyRun(strategy="HYBRID_SHARD", hybrid_mesh=(2, 2), model="gpt")),
    ],
    ids=["2-gpt", "4-uneven", "4-hybrid-dtensor"],
)
def test_sharded_values_have_fsdp1s_form(world_size: int, run: LegacyRun) -> None:
    for rank, out in enumerate(run_on_ranks(world_size, _form_body, run=run)):
        assert list(out["shardkit"]) == list(out["torch"]), rank
        for key in out["torch"]:
            assert_same_form(out["shardkit"][key], out["torch"][key], f"rank {rank} {key}")


def _dcp_body(rank: int, world_size: int, run: LegacyRun, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for source, target in (("torch", "shardkit"), ("shardkit", "torch")):
        model = wrap_model(source, run)
        opt = plain_sgd(model)
        train_steps(model, opt, run, range(3))
        where = f"{path}/{source}"
        dcp_save(state_dict_of(source, model, "SHARDED_STATE_DICT"), checkpoint_id=where)
        out[f"{source}/after"] = train_steps(model, opt, run, range(3, 5))
        loaded = fresh(target, run)
        template = state_dict_of(target, loaded, "SHARDED_STATE_DICT")
        dcp_load(template, checkpoint_id=where)
        load_into(target, loaded, "SHARDED_STATE_DICT", template)
        out[f"{target}/resumed"] = train_steps(loaded, plain_sgd(loaded), run, range(3, 5))
    return out


def test_dcp_checkpoints_interchange_with_fsdp1(tmp_path: Any) -> None:
    run = LegacyRun(model="gpt")
    out = run_on_ranks(2, _dcp_body, run=run, path=str(tmp_path))[0]
    torch.testing.assert_close(out["shardkit/resumed"], out["torch/after"])
    torch.testing.assert_close(out["torch/resumed"], out["shardkit/after"])


def _save_body(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    run = LegacyRun(model="gpt")
    model = wrap_model("shardkit", run)
    train_steps(model, plain_sgd(model), run, range(2))
    dcp_save(state_dict_of("shardkit", model, "SHARDED_STATE_DICT"), checkpoint_id=path)
    return full_params("shardkit", model)


def _load_body(rank: int, world_size: int, path: str, impl: str) -> dict[str, torch.Tensor]:
    run = LegacyRun(model="gpt", strategy="SHARD_GRAD_OP")
    model = fresh(impl, run)
    template = state_dict_of(impl, model, "SHARDED_STATE_DICT")
    dcp_load(template, checkpoint_id=path)
    load_into(impl, model, "SHARDED_STATE_DICT", template)
    return full_params(impl, model)


def test_a_checkpoint_saved_on_2_ranks_loads_on_4(tmp_path: Any) -> None:
    saved = run_on_ranks(2, _save_body, path=str(tmp_path))[0]
    for impl in ("shardkit", "torch"):
        loaded = run_on_ranks(4, _load_body, path=str(tmp_path), impl=impl)
        for rank, params in enumerate(loaded):
            assert params.keys() == saved.keys()
            for name in saved:
                torch.testing.assert_close(params[name], saved[name], msg=f"{impl} {rank} {name}")
