"""torch's DCP state-dict helpers on an FSDP1 model of shardkit.legacy, under ``patch_torch``.

``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``set_*`` (torch's
``torch.distributed.checkpoint.state_dict``) call FSDP1's class methods on the class they
imported. While torch is patched they see this package's wrappers: the oracle is the same
helpers on torch's FSDP1 model, unpatched, trained alike. Checked on a 1-D model (W=2) and a
tensor-parallel one (dp 2 x tp 2, W=4), sharded and full.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from harness.pool import run_on_ranks
from shardkit.core import patched_torch
from tests.core import models
from tests.legacy.legacy_parity import lib
from tests.legacy.optim_support import assert_same, comparable
from tests.tp import tp_models


def _one_d(impl: str) -> nn.Module:
    ns = lib(impl)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: nn.Module = ns.FSDP(
            models.build("mlp"),
            device_id=torch.device("cpu"),
            use_orig_params=True,
            auto_wrap_policy=ns.ModuleWrapPolicy({models.Block}),
        )
    return model


def _two_d(impl: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    module = tp_models.build("mlp", seed=0)
    tp_models.parallelize("mlp", module, mesh["tp"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: nn.Module = lib(impl).FSDP(
            module, device_mesh=mesh["dp"], use_orig_params=True, device_id=torch.device("cpu")
        )
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, kind: str, step: int) -> float:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if kind == "1d":
        x, y = models.batch("mlp", step, 2 * world)
        loss = models.loss_of("mlp", model(x.chunk(world)[rank]), y.chunk(world)[rank])
    else:
        dp = rank // 2
        x, y = tp_models.batch("mlp", step, 4)
        loss = tp_models.loss_of("mlp", model(x.chunk(2)[dp]), y.chunk(2)[dp])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _helpers(impl: str, kind: str) -> dict[str, Any]:
    model = (_one_d if kind == "1d" else _two_d)(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        _step(model, opt, kind, step)
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for full in (False, True):
            options = StateDictOptions(full_state_dict=full)
            msd = get_model_state_dict(model, options=options)
            osd = get_optimizer_state_dict(model, opt, options=options)
            out[f"model/{full}"] = comparable(msd)
            out[f"optim/{full}"] = comparable(osd)
        # The forms loaded back into a fresh model and optimizer go on training alike: the
        # full ones in 1-D, the sharded ones in 2-D (torch's FSDP1 fails to load its own full
        # 2-D model state dict there).
        options = StateDictOptions(full_state_dict=kind == "1d")
        msd = get_model_state_dict(model, options=options)
        osd = get_optimizer_state_dict(model, opt, options=options)
        fresh = (_one_d if kind == "1d" else _two_d)(impl)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        set_model_state_dict(fresh, msd, options=options)
        set_optimizer_state_dict(fresh, fresh_opt, osd, options=options)
    out["resumed"] = [_step(fresh, fresh_opt, kind, step) for step in range(2, 4)]
    out["continued"] = [_step(model, opt, kind, step) for step in range(2, 4)]
    return out


def _body(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    out = {"torch": _helpers("torch", kind)}
    with patched_torch():
        out["shardkit"] = _helpers("shardkit", kind)
    return out


def _check(results: list[dict[str, Any]], one_rank: bool = False) -> None:
    for rank, out in enumerate(results):
        ours, theirs = out["shardkit"], out["torch"]
        for key in ("model/False", "model/True", "optim/False", "optim/True"):
            assert_same(ours[key], theirs[key], f"rank {rank} {key}")
        assert ours["resumed"] == ours["continued"]
        if one_rank:  # see test_..._on_one_rank_as_torchs_fsdp1
            assert ours["resumed"] == theirs["resumed"]
        else:
            assert ours["continued"] == theirs["continued"]


def test_dcp_helpers_see_a_legacy_model_as_torchs_fsdp1() -> None:
    _check(run_on_ranks(2, _body, kind="1d"))


def test_dcp_helpers_see_a_legacy_model_on_one_rank_as_torchs_fsdp1() -> None:
    # A world of one is NO_SHARD: with use_orig_params=True FSDP1's sharded optimizer state
    # is the optimizer's own whole tensors, and ours too. FSDP1 also loads them without a
    # copy, so the fresh optimizer steps the very tensors of the one they came from and the
    # first model's "continued" run is not its own any more; shardkit copies on load.
    _check(run_on_ranks(1, _body, kind="1d"), one_rank=True)


def test_dcp_helpers_see_a_tensor_parallel_legacy_model_as_torchs_fsdp1() -> None:
    _check(run_on_ranks(4, _body, kind="2d"))
