"""A state dict that is not this Muon's is refused by name, the same on every rank, unloaded.

Each case takes a real state dict after two steps and bends one thing. The optimizer must
raise, naming the parameter and the key, and keep its state and hyperparameters as they were
(the model is not the optimizer's to touch). Sharded, a bent row block on one rank only must
make every rank raise the same error. See optim/state_checks.py for what is refused and why.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from harness.pool import run_on_ranks
from shardkit.core import fully_shard
from shardkit.core.optim import Muon

StateDict = dict[str, Any]
FIRST = "0.weight"


def _buffer(sd: StateDict) -> Any:
    return sd["state"][0]["momentum_buffer"]


def _set_buffer(value: Callable[[Any], Any]) -> Callable[[StateDict], None]:
    def bend(sd: StateDict) -> None:
        sd["state"][0]["momentum_buffer"] = value(_buffer(sd))

    return bend


def _nan(t: Any) -> Any:
    t = t.clone()
    (t.to_local() if isinstance(t, DTensor) else t).view(-1)[0] = float("nan")
    return t


def _drop_group_key(key: str) -> Callable[[StateDict], None]:
    return lambda sd: sd["param_groups"][0].pop(key)


def _set_group(key: str, value: Any) -> Callable[[StateDict], None]:
    return lambda sd: sd["param_groups"][0].__setitem__(key, value)


# (bend the state dict, error type, what the message says)
CASES: dict[str, tuple[Callable[[StateDict], None], type[Exception], str]] = {
    "shape": (_set_buffer(lambda t: torch.zeros(3, 3)), ValueError, "has shape \\(3, 3\\)"),
    "dtype": (_set_buffer(lambda t: t.double()), ValueError, "is torch.float64"),
    "not a tensor": (_set_buffer(lambda t: 0.5), TypeError, "is a float, not a tensor"),
    "nan": (_set_buffer(_nan), ValueError, "NaN or infinite"),
    "missing key": (
        lambda sd: sd["state"][0].pop("momentum_buffer"),
        ValueError,
        "missing \\['momentum_buffer'\\]",
    ),
    "extra key": (
        lambda sd: sd["state"][0].__setitem__("exp_avg", _buffer(sd)),
        ValueError,
        "extra \\['exp_avg'\\]",
    ),
    "unknown parameter": (
        lambda sd: sd["state"].__setitem__(99, copy.deepcopy(sd["state"][0])),
        ValueError,
        "state for parameter 99",
    ),
    "group count": (
        lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])),
        ValueError,
        "2 parameter groups, this optimizer has 1",
    ),
    "param count": (
        lambda sd: sd["param_groups"][0]["params"].pop(),
        ValueError,
        "has 1 parameters, this one 2",
    ),
    "param names": (
        _set_group("param_names", ["1.weight", "0.weight"]),
        ValueError,
        "state of '1.weight' would load into '0.weight'",
    ),
    "another optimizer's group": (
        _drop_group_key("ns_steps"),
        ValueError,
        "has no \\['ns_steps'\\]",
    ),
    "bad hyperparameter": (
        _set_group("ns_steps", 200),
        ValueError,
        "Number of steps must be less than 100",
    ),
    "negative lr": (_set_group("lr", -1.0), ValueError, "lr should be >= 0"),
}


def _trained(model: nn.Module, x: torch.Tensor) -> Muon:
    opt = Muon(model.named_parameters(), lr=0.02)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _snapshot(opt: Muon) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).clone()

    buffers = [full(s["momentum_buffer"]) for s in opt.state.values()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return buffers, copy.deepcopy(groups)


def _same(a: tuple[list[torch.Tensor], list[Any]], b: tuple[list[torch.Tensor], list[Any]]) -> bool:
    return a[1] == b[1] and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 5, bias=False))


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_state_dict_is_refused_and_nothing_loads(case: str) -> None:
    bend, error, message = CASES[case]
    opt = _trained(_model(), torch.randn(3, 4))
    sd = copy.deepcopy(opt.state_dict())
    bend(sd)
    before = _snapshot(opt)
    with pytest.raises(error, match=message) as raised:
        opt.load_state_dict(sd)
    if case not in ("group count", "param count", "param names", "unknown parameter"):
        assert FIRST in str(raised.value)  # the parameter, by name (its group's first)
    assert _same(_snapshot(opt), before)


def test_the_state_dict_it_saved_loads() -> None:
    opt = _trained(_model(), torch.randn(3, 4))
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5  # a schedule's lr is the checkpoint's to say
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.5


def _another_layout(t: DTensor) -> DTensor:
    return t.redistribute(t.device_mesh, [Replicate()])


def _nan_on_last_rank(t: DTensor) -> Any:
    import torch.distributed as dist

    return _nan(t) if dist.get_rank() == dist.get_world_size() - 1 else t.clone()


SHARDED: dict[str, Callable[[StateDict], None]] = {
    "shape": CASES["shape"][0],
    "another layout": _set_buffer(_another_layout),
    "plain full tensor": _set_buffer(lambda t: t.full_tensor()),
    "nan on the last rank only": _set_buffer(_nan_on_last_rank),
}


def _sharded_body(rank: int, world_size: int, case: str) -> dict[str, Any]:
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = _trained(model, torch.randn(3, 4))
    sd = copy.copy(opt.state_dict())
    sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
    SHARDED[case](sd)
    before = _snapshot(opt)
    try:
        opt.load_state_dict(sd)
    except (ValueError, TypeError) as error:
        return {"error": f"{type(error).__name__}: {error}", "same": _same(_snapshot(opt), before)}
    return {"error": "", "same": _same(_snapshot(opt), before)}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("shape", "has shape (3, 3)"),
        ("another layout", "is laid out as (Replicate(),) on mesh (2,)"),
        ("plain full tensor", "is a plain tensor, the parameter is sharded"),
        ("nan on the last rank only", "rank 1: Muon: 0.weight: state 'momentum_buffer' holds NaN"),
    ],
)
def test_every_rank_refuses_a_sharded_hostile_state_alike(case: str, message: str) -> None:
    results = run_on_ranks(2, _sharded_body, case=case)
    assert results[0]["error"] == results[1]["error"], results
    assert message in results[0]["error"], results[0]["error"]
    assert FIRST in results[0]["error"]
    assert all(r["same"] for r in results)
