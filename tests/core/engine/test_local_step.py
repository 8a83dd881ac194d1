"""Elementwise optimizers step the sharded parameters' local tensors (see [Note: local
optimizer step]): the same parameters and optimizer state as torch's fully_shard, whose
optimizer steps through DTensor's dispatcher, and DTensors everywhere outside ``step()``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models, parity


class AdamSubclass(torch.optim.Adam):
    """A subclass may step differently from its base: never taken as elementwise."""


OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "sgd_nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adam_subclass": (AdamSubclass, {"lr": 1e-2}),  # not elementwise-listed: DTensor path
}
# The other elementwise optimizers: checked at W=2 only (W=1 takes the same path).
MORE_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0, "weight_decay": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.01}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2, "t0": 1}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2, "decoupled_weight_decay": True}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "rmsprop_centered": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9, "centered": True}),
}


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _train(impl: str, rank: int, world_size: int, optimizer: str) -> dict[str, Any]:
    run = parity.Run(model="gpt", impls=(impl,))
    model = models.build("gpt")
    parity.apply(impl, model, parity.make_mesh(run, world_size), run)
    cls, kwargs = {**OPTIMIZERS, **MORE_OPTIMIZERS}[optimizer]
    opt = cls(model.parameters(), **kwargs)
    seen: list[str] = []  # what the optimizer's own step hook sees
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append(type(o.param_groups[0]["params"][0]).__name__)
    )
    params = list(model.parameters())
    first_state: list[dict[str, Any]] = []
    for step in range(3):
        x, y = parity.rank_batch("gpt", step, rank, world_size, impl)
        models.loss_of("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            first_state = [opt.state[p] for p in params]
    state = opt.state_dict()["state"]
    return {
        "params": parity.full_params(model),
        "state": {i: {k: _full(v) for k, v in s.items()} for i, s in state.items()},
        "state_types": sorted({type(v).__name__ for s in state.values() for v in s.values()}),
        "same_params": all(
            a is b for a, b in zip(params, opt.param_groups[0]["params"], strict=True)
        ),
        "keys_are_params": all(any(k is p for p in params) for k in opt.state),
        "placements_kept": all(
            v.placements == p.placements
            for p in params
            for v in opt.state[p].values()
            if isinstance(v, DTensor)
        ),
        "hook_saw": sorted(set(seen)),
        # Each parameter's state dict is one object over the steps, as the optimizer made it.
        "same_state_dicts": all(
            a is opt.state[p] for a, p in zip(first_state, params, strict=True)
        ),
    }


def _both(rank: int, world_size: int, optimizer: str) -> dict[str, Any]:
    return {impl: _train(impl, rank, world_size, optimizer) for impl in ("shardkit", "torch")}


def _assert_same_params_and_state(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Parameters and optimizer state equal bit for bit (``theirs``: torch's run)."""
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        for key, value in state.items():
            assert torch.equal(ours["state"][index][key], value), (index, key)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_matches_torch_bit_for_bit(world_size: int, optimizer: str) -> None:
    result = run_on_ranks(world_size, _both, optimizer=optimizer)[0]
    ours, torch_ = result["shardkit"], result["torch"]
    _assert_same_params_and_state(ours, torch_)
    # Outside step() the optimizer holds the same parameters and DTensor state as torch's.
    assert ours["state_types"] == torch_["state_types"]
    assert "DTensor" in ours["state_types"]
    assert ours["same_params"] and ours["keys_are_params"] and ours["placements_kept"]
    assert ours["same_state_dicts"] and torch_["same_state_dicts"]
    # Inside step() an elementwise optimizer sees local tensors; any other, DTensors.
    local = optimizer != "adam_subclass"
    assert ours["hook_saw"] == (["Tensor"] if local else ["DTensor"])
    assert torch_["hook_saw"] == ["DTensor"]


@pytest.mark.parametrize("optimizer", list(MORE_OPTIMIZERS))
def test_every_elementwise_optimizer_matches_torch_bit_for_bit(optimizer: str) -> None:
    result = run_on_ranks(2, _both, optimizer=optimizer)[0]
    ours, torch_ = result["shardkit"], result["torch"]
    _assert_same_params_and_state(ours, torch_)
    assert ours["state_types"] == torch_["state_types"]
    assert ours["same_params"] and ours["keys_are_params"] and ours["placements_kept"]
    assert ours["hook_saw"] == ["Tensor"]


def _failed_step(rank: int, world_size: int) -> dict[str, Any]:
    run = parity.Run(model="gpt", impls=("shardkit",))
    model = models.build("gpt")
    parity.apply("shardkit", model, parity.make_mesh(run, world_size), run)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fail = [True]

    def pre_hook(o: Any, args: Any, kwargs: Any) -> None:
        if fail.pop():
            raise RuntimeError("injected")

    opt.register_step_pre_hook(pre_hook)
    fail.insert(0, False)  # the second step goes through
    x, y = parity.rank_batch("gpt", 0, rank, world_size, "shardkit")
    models.loss_of("gpt", model(x), y).backward()
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    swapped = type(opt.param_groups[0]["params"][0]).__name__
    opt.zero_grad()  # on the local tensors: the DTensors' gradients go at the next forward
    out = model(x)
    cleared = all(p.grad is None for p in model.parameters())
    models.loss_of("gpt", out, y).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()
    state_dict = opt.state_dict()
    return {
        "swapped": swapped,
        "cleared": cleared,
        "grads": grads,
        "after": type(opt.param_groups[0]["params"][0]).__name__,
        "state_types": sorted(
            {type(v).__name__ for s in state_dict["state"].values() for v in s.values()}
        ),
    }


def _one_backward(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    run = parity.Run(model="gpt", impls=("shardkit",))
    model = models.build("gpt")
    parity.apply("shardkit", model, parity.make_mesh(run, world_size), run)
    x, y = parity.rank_batch("gpt", 0, rank, world_size, "shardkit")
    models.loss_of("gpt", model(x), y).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_a_step_that_raises_is_put_back() -> None:
    result = run_on_ranks(2, _failed_step)[0]
    expected = run_on_ranks(2, _one_backward)[0]
    assert result["swapped"] == "Tensor"  # left as the failed step left it...
    assert result["cleared"]  # ...until the next forward, which clears the stale gradients
    for name, grad in expected.items():
        assert torch.equal(result["grads"][name], grad), name
    assert result["after"] == "DTensor"
    assert result["state_types"] == ["DTensor", "Tensor"]


def _edited_between_steps(rank: int, world_size: int, impl: str) -> dict[str, Any]:
    """AdamW with the user changing the optimizer between steps, each change in another way."""
    run = parity.Run(model="gpt", impls=(impl,))
    model = models.build("gpt")
    parity.apply(impl, model, parity.make_mesh(run, world_size), run)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    first = next(iter(model.parameters()))
    moved = first
    for step in range(5):
        x, y = parity.rank_batch("gpt", step, rank, world_size, impl)
        models.loss_of("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:  # a state value replaced by a new object
            opt.state[first]["exp_avg_sq"] = opt.state[first]["exp_avg_sq"] * 2
        elif step == 1:  # the whole state replaced
            opt.load_state_dict(opt.state_dict())
        elif step == 2:  # a group's list edited in place: its last parameter stops training
            moved = opt.param_groups[0]["params"].pop()
        elif step == 3:  # a new group, and a new step count (as a schedule restart writes)
            opt.add_param_group({"params": [moved], "lr": 3e-2})
            opt.state[first]["step"] = torch.tensor(1.0)
    state = opt.state_dict()["state"]
    return {
        "params": parity.full_params(model),
        "state": {i: {k: _full(v) for k, v in s.items()} for i, s in state.items()},
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_changes_between_steps_are_seen(world_size: int) -> None:
    # The swap is planned once and reused: every way the user can change what the optimizer
    # holds between steps must still reach the step, as it does on torch's DTensors.
    ours = run_on_ranks(world_size, _edited_between_steps, impl="shardkit")[0]
    theirs = run_on_ranks(world_size, _edited_between_steps, impl="torch")[0]
    _assert_same_params_and_state(ours, theirs)
