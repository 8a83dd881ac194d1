"""``MixedPrecisionPolicy(param_dtype_override_fn=...)``: some parameters kept in their own dtype.

Torch 2.15's per-parameter ``param_dtype``: a router kept in fp32 inside a bf16 group. The
oracles: torch's ``fully_shard`` with the router sharded in a call of its own without
``param_dtype`` (every release: the same dtypes everywhere, so the same bits), and from 2.15
on torch's own ``param_dtype_override_fn``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy, fully_shard
from tests.core.parity import fully_shard_of, torch_policy
from tests.core.torch_releases import torch_has

HIDDEN = 8
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class _Router(nn.Linear):
    """Computes in its weight's dtype, whatever its input's: fp32 where it is kept so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), _Router(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 2)
    )


def _keep_router(model: nn.Sequential) -> MixedPrecisionPolicy:
    kept = {id(p) for p in model[2].parameters()}
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_override_fn=lambda p: p.dtype if id(p) in kept else None,
    )


def _shard(way: str, model: nn.Sequential, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    if way == "separate call":  # torch's fully_shard, the router in a group of its own
        fs = fully_shard_of("torch")
        fs(model[2], mesh=mesh, mp_policy=torch_policy(MixedPrecisionPolicy()))
        fs(model, mesh=mesh, mp_policy=torch_policy(BF16))
    elif way == "torch override":
        fully_shard_of("torch")(model, mesh=mesh, mp_policy=torch_policy(_keep_router(model)))
    elif way == "torch's policy object":  # code that builds torch's policy, on shardkit
        fully_shard(model, mesh=mesh, mp_policy=torch_policy(_keep_router(model)))
    else:
        fully_shard(model, mesh=mesh, mp_policy=_keep_router(model))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(way: str, rank: int, world_size: int) -> dict[str, Any]:
    model = _model()
    _shard(way, model, world_size)
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    first: Any = model[0]
    model[2].register_forward_pre_hook(
        lambda m, args: seen.append((m.weight.dtype, first.weight.dtype))
    )
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(3):
        data = torch.Generator().manual_seed(100 * step + rank)
        x, target = torch.randn(4, HIDDEN, generator=data), torch.randn(4, 2, generator=data)
        loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().clone())
    return {
        "losses": losses,
        "params": [_full(p) for p in model.parameters()],
        "dtypes": seen[0],
    }


def _body(rank: int, world_size: int) -> dict[str, Any]:
    ways = ["shardkit", "separate call"]
    if torch_has("MixedPrecisionPolicy.param_dtype_override_fn"):
        ways += ["torch override", "torch's policy object"]
    return {way: _train(way, rank, world_size) for way in ways}


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_router_kept_in_fp32_trains_as_torch(world_size: int) -> None:
    for rank, runs in enumerate(run_on_ranks(world_size, _body)):
        ours = runs.pop("shardkit")
        assert ours["dtypes"] == (torch.float32, torch.bfloat16), "router fp32, the rest bf16"
        for way, theirs in runs.items():
            assert theirs["dtypes"] == ours["dtypes"], way
            for key in ("losses", "params"):
                assert all(
                    torch.equal(a, b) for a, b in zip(ours[key], theirs[key], strict=True)
                ), f"rank {rank}: {key} differ from {way}"


def _refusal_body(rank: int, world_size: int, answer: Any) -> tuple[str, bool]:
    model = _model()
    router = model[2].weight
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        param_dtype_override_fn=lambda p: answer if p is router else None,
    )
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)), mp_policy=policy)
    except ValueError as error:
        return str(error), type(model) is nn.Sequential and model[2].weight is router
    return "", False


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (torch.float16, r"returned torch.float16 for parameter 2\.weight; it may return None, "),
        ("fp32", r"returned a str for parameter 2\.weight; it must return a torch.dtype"),
    ],
)
def test_a_bad_answer_is_refused_by_parameter_before_anything_changes(
    answer: Any, message: str
) -> None:
    for error, unchanged in run_on_ranks(2, _refusal_body, answer=answer):
        assert re.search(message, error), error
        assert unchanged


def test_the_function_must_be_callable() -> None:
    with pytest.raises(TypeError, match="param_dtype_override_fn must be callable"):
        MixedPrecisionPolicy(param_dtype_override_fn=torch.float32)  # type: ignore[arg-type]
