"""FSDP1's flat parameters (use_orig_params=False), against torch's FSDP1 with the same.

Same seed and data on both: one flat parameter per unit under FSDP1's names, the same losses
with SGD, Adam and AdamW (gradients clipped once), an optimizer built before wrapping still
training the model, gradients accumulated over two backwards, and the optimizer-state APIs
giving FSDP1's per-parameter forms from the flat optimizer and loading them back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core.layout import GroupView
from shardkit.legacy.flat_params import flat_of
from tests.core import models
from tests.legacy.legacy_parity import global_loss, lib

STEPS = 3
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _wrap(impl: str, module: nn.Module) -> Any:
    ns = lib(impl)
    return ns.FSDP(
        module,
        device_id=torch.device("cpu"),
        use_orig_params=False,
        auto_wrap_policy=ns.ModuleWrapPolicy({models.Block}),
    )


def _step(model: Any, opt: torch.optim.Optimizer, step: int) -> float:
    rank = torch.distributed.get_rank()
    world_size = torch.distributed.get_world_size()
    x, y = models.batch("mlp", step, 2 * world_size)
    loss = models.loss_of("mlp", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
    loss.backward()
    if step == 1:
        model.clip_grad_norm_(0.05)
    opt.step()
    opt.zero_grad()
    return global_loss(loss, world_size)


def _train(impl: str, optimizer: str, before: bool = False) -> tuple[Any, Any, list[float]]:
    torch.manual_seed(0)
    module = models.build("mlp")
    opt = OPTIMIZERS[optimizer](module.parameters()) if before else None
    model = _wrap(impl, module)
    if opt is None:
        opt = OPTIMIZERS[optimizer](model.parameters())
    return model, opt, [_step(model, opt, step) for step in range(STEPS)]


def _tensors(osd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        f"{name}/{k}": v.detach().float().clone()
        for name, entry in osd["state"].items()
        for k, v in entry.items()
    }


def _accumulated(impl: str) -> list[float]:
    """Two backwards per step without zero_grad between; zero_grad keeping zeros after."""
    torch.manual_seed(0)
    model = _wrap(impl, models.build("mlp"))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in range(2):
        for micro in range(2):
            x, y = models.batch("mlp", 2 * step + micro, 2 * world_size)
            out = model(x.chunk(world_size)[rank])
            loss = models.loss_of("mlp", out, y.chunk(world_size)[rank])
            loss.backward()
            losses.append(global_loss(loss, world_size))
        opt.step()
        opt.zero_grad(set_to_none=step == 1)
    return losses


def _body(rank: int, world_size: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        model = _wrap(impl, models.build("mlp"))
        named = [(n, tuple(p.shape), p.dim()) for n, p in model.named_parameters()]
        out[f"{impl}/names"] = [n for n, _, _ in named]
        out[f"{impl}/one dim"] = all(d == 1 for _, _, d in named)
        for optimizer in OPTIMIZERS:
            out[f"{impl}/{optimizer}"] = _train(impl, optimizer)[2]
        ns = lib(impl)
        model, opt, _ = _train(impl, "adam")
        full = ns.FSDP.full_optim_state_dict(model, opt, rank0_only=False)
        out[f"{impl}/full"] = _tensors(full)
        out[f"{impl}/groups"] = full["param_groups"][0]["params"]
        with ns.FSDP.state_dict_type(model, ns.StateDictType.FULL_STATE_DICT):
            osd = ns.FSDP.optim_state_dict(model, opt)
            out[f"{impl}/osd"] = _tensors(osd)
            fresh = OPTIMIZERS["adam"](model.parameters())
            fresh.load_state_dict(ns.FSDP.optim_state_dict_to_load(model, fresh, osd))
        out[f"{impl}/reloaded"] = _tensors(
            ns.FSDP.full_optim_state_dict(model, fresh, rank0_only=False)
        )
        out[f"{impl}/next"] = _step(model, fresh, STEPS)
        out[f"{impl}/accumulated"] = _accumulated(impl)
    out["shardkit/before"] = _train("shardkit", "adam", before=True)[2]
    # model.to(dtype) moves the shards into a new buffer: the same flat parameter follows.
    model = _wrap("shardkit", models.build("mlp"))
    flat = next(model.parameters())
    unit = flat_of(flat)
    assert unit is not None
    original = unit.originals[0]
    assert isinstance(original, DTensor)
    model.double()
    model(models.batch("mlp", 0, 2)[0].double())
    local = original.to_local()
    out["moved"] = (
        next(model.parameters()) is flat
        and flat.dtype == torch.float64
        and flat.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
    )
    # A unit's flat gradient is the engine's reduction itself, laid out as the flat shard
    # (not a new tensor each gradient is copied into): the first hook of a step finds it.
    found: list[bool] = []
    flat_grad_of = GroupView.flat_grad_of

    def spy(group: GroupView, index: int) -> torch.Tensor | None:
        grad = flat_grad_of(group, index)
        found.append(grad is not None)
        return grad

    with mock.patch.object(GroupView, "flat_grad_of", spy):
        out["shardkit/spied"] = _train("shardkit", "adam")[2]
    out["reduced in place"] = found
    return out


def test_flat_parameters_train_and_save_optimizer_state_as_fsdp1s() -> None:
    for out in run_on_ranks(2, _body):
        assert out["shardkit/names"] == out["torch/names"]
        assert out["shardkit/names"][0] == "_fsdp_wrapped_module._flat_param"
        assert out["shardkit/one dim"] and out["torch/one dim"]
        for optimizer in OPTIMIZERS:
            assert out[f"shardkit/{optimizer}"] == out[f"torch/{optimizer}"], optimizer
        assert out["shardkit/before"] == out["torch/adam"]
        assert out["shardkit/spied"] == out["torch/adam"]
        assert out["reduced in place"] == [True] * STEPS * len(out["shardkit/names"])
        assert out["shardkit/groups"] == out["torch/groups"]
        for form in ("full", "osd", "reloaded"):
            ours, theirs = out[f"shardkit/{form}"], out[f"torch/{form}"]
            assert sorted(ours) == sorted(theirs), form
            for key, value in theirs.items():
                # The clip's total norm sums each rank's squares over each engine's own shards
                # (FSDP1: a run of the flat parameter; shardkit: each parameter's rows): equal
                # up to the last bits, which depend on the CPU's vector width (bit for bit on
                # the machine this test was written on, an ulp apart on an AVX-512 Xeon).
                # Within a millionth of the tensor's largest value, and the step after it too;
                # the clipping itself is compared in tests/legacy/test_runtime.py.
                scale = float(value.abs().max()) if value.is_floating_point() else 0.0
                torch.testing.assert_close(ours[key], value, rtol=1e-6, atol=1e-6 * scale, msg=key)
        assert out["shardkit/next"] == pytest.approx(out["torch/next"], rel=1e-6)
        assert out["shardkit/accumulated"] == out["torch/accumulated"]
        assert out["moved"]
