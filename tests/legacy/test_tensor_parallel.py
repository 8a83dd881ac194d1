"""FSDP1 on a tensor-parallel model (device_mesh = the "dp" slice of a 2D mesh), as FSDP1."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.legacy.ckpt_support import load_into, state_dict_of
from tests.legacy.legacy_parity import lib
from tests.legacy.optim_support import assert_same, comparable
from tests.tp import tp_models

MODEL = "mlp"  # Linear 4 -> 6 -> 8 -> 10, colwise / rowwise / colwise: uneven cuts


def _model(impl: str, seed: int = 0) -> Any:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_models.build(MODEL, seed=seed)
    tp_models.parallelize(MODEL, model, mesh["tp"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib(impl).FSDP(
            model, device_mesh=mesh["dp"], use_orig_params=True, device_id=torch.device("cpu")
        )


def _train(model: Any, steps: range, opt: Any = None) -> list[float]:
    dp = torch.distributed.get_rank() // 2  # the data-parallel coordinate of (dp, tp)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in steps:
        x, y = tp_models.batch(MODEL, step, 4)
        x, y = x.chunk(2)[dp], y.chunk(2)[dp]
        loss = tp_models.loss_of(MODEL, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _body(rank: int, world_size: int, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        model = _model(impl)
        out[f"{impl}/losses"] = _train(model, range(2))
        sharded = state_dict_of(impl, model, "SHARDED_STATE_DICT")
        out[f"{impl}/sharded"] = comparable(sharded)
        dcp_save(sharded, checkpoint_id=f"{path}/{impl}")
        out[f"{impl}/after"] = _train(model, range(2, 4))
    for source, target in (("torch", "shardkit"), ("shardkit", "torch")):
        model = _model(target, seed=3)
        template = state_dict_of(target, model, "SHARDED_STATE_DICT")
        dcp_load(template, checkpoint_id=f"{path}/{source}")
        load_into(target, model, "SHARDED_STATE_DICT", template)
        out[f"{target}/resumed"] = _train(model, range(2, 4))
    return out


def _optim_body(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for impl in ("shardkit", "torch"):
        model = _model(impl)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        _train(model, range(2), opt)
        ns = lib(impl)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ns.FSDP.state_dict_type(model, ns.StateDictType.SHARDED_STATE_DICT):
                out[impl] = comparable(ns.FSDP.optim_state_dict(model, opt))
    return out


def test_2d_sharded_optimizer_state_matches_fsdp1() -> None:
    for rank, out in enumerate(run_on_ranks(4, _optim_body)):
        assert_same(out["shardkit"], out["torch"], f"rank {rank}")


def test_2d_training_and_sharded_state_dicts_match_fsdp1(tmp_path: Path) -> None:
    for rank, out in enumerate(run_on_ranks(4, _body, path=str(tmp_path))):
        torch.testing.assert_close(out["shardkit/losses"], out["torch/losses"])
        assert_same(out["shardkit/sharded"], out["torch/sharded"], f"rank {rank}")
        torch.testing.assert_close(out["shardkit/resumed"], out["torch/after"])
        torch.testing.assert_close(out["torch/resumed"], out["shardkit/after"])


def _sync_body(rank: int, world_size: int) -> dict[str, Any]:
    # Each data-parallel rank builds its own values; sync_module_states gives every rank
    # the first data-parallel rank's (the tensor-parallel pieces stay each rank's own).
    dp = rank // 2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_models.build(MODEL, seed=dp)
    tp_models.parallelize(MODEL, model, mesh["tp"])
    expected = tp_models.build(MODEL, seed=0)
    tp_models.parallelize(MODEL, expected, mesh["tp"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = lib("shardkit").FSDP(
            model,
            device_mesh=mesh["dp"],
            sync_module_states=True,
            device_id=torch.device("cpu"),
        )
    with lib("shardkit").FSDP.summon_full_params(wrapped, writeback=False):
        got = {n: p.full_tensor() for n, p in wrapped.named_parameters()}
    want = {n: p.full_tensor() for n, p in expected.named_parameters()}
    return {"got": got, "want": want}


def test_sync_module_states_broadcasts_tensor_parallel_parameters() -> None:
    for out in run_on_ranks(4, _sync_body):
        assert out["got"].keys() == out["want"].keys()
        for name, value in out["want"].items():
            torch.testing.assert_close(out["got"][name], value, msg=name)
