"""An optimizer built before the wrapper trains the model, as with FSDP1's use_orig_params.

torch's FSDP1 is the oracle: the losses of every step and the parameters after them, for an
optimizer built before and after wrapping, with ``use_orig_params`` True and False.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from harness.pool import run_on_ranks
from tests.core import models
from tests.legacy.legacy_parity import full_params, global_loss, lib

STEPS = 4


def _wrap(impl: str, module: nn.Module, use_orig_params: bool) -> Any:
    ns = lib(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ns.FSDP(
            module,
            device_id=torch.device("cpu"),
            use_orig_params=use_orig_params,
            auto_wrap_policy=ns.ModuleWrapPolicy({models.Block}),
        )


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    rank = torch.distributed.get_rank()
    world_size = torch.distributed.get_world_size()
    x, y = models.batch("mlp", step, 2 * world_size)
    loss = models.loss_of("mlp", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return global_loss(loss, world_size)


def _train(impl: str, use_orig_params: bool, before: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    module = models.build("mlp")
    opt = torch.optim.Adam(module.parameters(), lr=0.01) if before else None
    model = _wrap(impl, module, use_orig_params)
    if opt is None:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [_step(model, opt, step) for step in range(STEPS)]
    held = [str(w.message) for w in caught if "still references" in str(w.message)]
    return {"losses": losses, "params": full_params(impl, model), "held_warnings": held}


def _orders_body(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {
        f"{impl}/{use_orig}/{before}": _train(impl, use_orig, before)
        for impl in ("shardkit", "torch")
        for use_orig in (True, False)
        for before in (True, False)
    }


def test_an_optimizer_built_before_wrapping_trains_the_model_as_fsdp1s() -> None:
    for out in run_on_ranks(2, _orders_body):
        oracle = out["torch/True/False"]  # FSDP1, optimizer built after wrapping
        for key in ("torch/True/True", "torch/False/False"):
            assert out[key]["losses"] == oracle["losses"], key
        for use_orig in (True, False):
            for before in (True, False):
                ours = out[f"shardkit/{use_orig}/{before}"]
                assert ours["losses"] == oracle["losses"], (use_orig, before)
                for name, value in oracle["params"].items():
                    torch.testing.assert_close(ours["params"][name], value, msg=name)
                assert ours["held_warnings"] == []
        # FSDP1 with flat parameters trains something else with such an optimizer (its
        # parameters are no longer the model's); shardkit trains the model there too.
        assert out["torch/False/True"]["losses"] != oracle["losses"]


def _refusals_body(rank: int, world_size: int) -> dict[str, str]:
    import shardkit.legacy as legacy

    out = {}
    # State from before wrapping is of full tensors: refused, naming the parameter.
    torch.manual_seed(0)
    module = models.build("mlp")
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    module(models.batch("mlp", 0, 2)[0]).sum().backward()
    opt.step()
    before = {k: v["exp_avg"].clone() for k, v in enumerate(opt.state.values())}
    model = _wrap("shardkit", module, True)
    with pytest.raises(RuntimeError) as caught:
        model(models.batch("mlp", 0, 2)[0])
    out["state"] = str(caught.value)
    out["unchanged"] = str(
        all(torch.equal(v["exp_avg"], before[k]) for k, v in enumerate(opt.state.values()))
        and all(
            not isinstance(p, torch.distributed.tensor.DTensor)
            for p in opt.param_groups[0]["params"]
        )
    )
    # A list taken before wrapping, made into an optimizer after the first forward: its step
    # is refused instead of training tensors the model no longer uses.
    torch.manual_seed(0)
    module = models.build("mlp")
    taken = list(module.parameters())
    model = _wrap("shardkit", module, True)
    model(models.batch("mlp", 0, 2)[0]).sum().backward()
    late = torch.optim.SGD(taken, lr=0.1)
    with pytest.raises(RuntimeError) as caught:
        late.step()
    out["late"] = str(caught.value)
    # The optimizer-state APIs re-point the optimizer they are given, before any forward.
    torch.manual_seed(0)
    module = models.build("mlp")
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    model = _wrap("shardkit", module, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with legacy.FSDP.state_dict_type(model, legacy.StateDictType.FULL_STATE_DICT):
            osd = legacy.FSDP.optim_state_dict(model, opt)
    names = {n.replace("_fsdp_wrapped_module.", "") for n, _ in model.named_parameters()}
    out["api"] = str(set(osd["param_groups"][0]["params"]) == names)
    return out


def test_optimizer_state_from_before_wrapping_and_late_optimizers_are_refused() -> None:
    for out in run_on_ranks(2, _refusals_body):
        assert "Adam has optimizer state for Linear.weight" in out["state"]
        assert out["unchanged"] == "True"
        assert "SGD steps Linear.weight" in out["late"]
        assert "build the optimizer" in out["late"].lower()
        assert out["api"] == "True"
