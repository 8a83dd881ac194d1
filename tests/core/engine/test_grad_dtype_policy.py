"""A ``grad_dtype`` set on parameters before sharding, as torch's ``fully_shard`` honours it.

From torch 2.15 a parameter's ``grad_dtype`` (``p.grad_dtype = torch.float32`` on a bf16
parameter; ``None``: any dtype) survives ``fully_shard``, ``module.to(dtype)`` and
``load_state_dict(assign=True)``, and with no ``reduce_dtype`` decides the dtype gradients
accumulate, reduce and arrive in. Earlier releases ignore it. Each case runs the same program
on torch's ``fully_shard`` and on shardkit's at W=2 and compares, bit for bit, what the program
sees: every parameter's ``grad_dtype`` and its override flag, each gradient's dtype and values,
the losses and the trained parameters. Found by torch's ``test_fully_shard_conversion.py`` on
2.15 (``scripts/torch_fsdp2_tests.py``): shardkit dropped the setting, and gave bf16 gradients
where torch gave fp32 ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardkit.core as shardkit_core
from harness.pool import run_on_ranks
from shardkit.core.torch_release import FOLLOWS_GRAD_DTYPE

_DIM = 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_DIM)
        self.proj = nn.Linear(_DIM, _DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.proj(self.norm(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block(), nn.Linear(_DIM, 4))


_ALL_FP32 = ("fp32", "to_bf16", "no_sync", "set_after", "assign", "hsdp")
# Kept in fp32 and computed in bf16 (MixedPrecisionPolicy), with bf16 gradients set on the
# linear weights only: the group reduces in fp32, and those arrive in bf16.
_MIXED = "mp_bf16_weight_grads"


def _set_grad_dtype(model: nn.Module, case: str) -> None:
    for name, p in model.named_parameters():
        everywhere = case in _ALL_FP32
        if everywhere or (case == "norms_fp32" and "norm" in name):
            p.grad_dtype = torch.float32
        elif case == "any":
            p.grad_dtype = None
        elif case == _MIXED and "proj.weight" in name:
            p.grad_dtype = torch.bfloat16


def _policy(model: nn.Module) -> list[Any]:
    return [
        (name, p.dtype, p.grad_dtype, getattr(p, "_has_grad_dtype_override", None))
        for name, p in model.named_parameters()
    ]


def _train(engine: str, case: str) -> dict[str, Any]:
    fully_shard = torch_fsdp.fully_shard if engine == "torch" else shardkit_core.fully_shard
    model: Any = _model()  # Sequential, then its sharded self
    if case not in ("to_bf16", _MIXED):
        model = model.to(torch.bfloat16)
    if case != "set_after":
        _set_grad_dtype(model, case)
    kwargs: dict[str, Any] = {}
    if case == "hsdp":  # the all-reduce across replicas runs in the set dtype too
        kwargs["mesh"] = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    if case == _MIXED:
        kwargs["mp_policy"] = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model[:2]:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if case == "set_after":  # on the sharded parameters, before the first forward
        _set_grad_dtype(model, case)
    if case == "to_bf16":
        model.to(torch.bfloat16)
    if case == "assign":  # new parameter objects, without the setting: they inherit it
        model.load_state_dict(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True
        )
    seen: dict[str, Any] = {"policy": _policy(model), "grads": [], "losses": []}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    microbatches = 2 if case == "no_sync" else 1
    for _ in range(3):
        for micro in range(microbatches):
            model.set_requires_gradient_sync(micro == microbatches - 1)
            x = torch.randn(4, _DIM).to(torch.bfloat16)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            seen["losses"].append(loss.detach())
        grads = []
        for name, p in model.named_parameters():
            assert isinstance(p.grad, DTensor), name
            grads.append((name, p.grad.dtype, p.grad.full_tensor()))
        seen["grads"].append(grads)
        optim.step()
        optim.zero_grad()
    seen["policy_after"] = _policy(model)
    seen["params"] = [p.full_tensor() for p in model.parameters()]
    return seen


def _both(rank: int, world_size: int, case: str) -> bool:
    torch_run, ours = _train("torch", case), _train("shardkit", case)
    assert ours["policy"] == torch_run["policy"], (ours["policy"], torch_run["policy"])
    assert ours["policy_after"] == torch_run["policy_after"]
    for step, (mine, theirs) in enumerate(zip(ours["grads"], torch_run["grads"], strict=True)):
        for (name, dtype, grad), (_, want_dtype, want) in zip(mine, theirs, strict=True):
            assert dtype == want_dtype, (step, name, dtype, want_dtype)
            assert torch.equal(grad, want), (step, name)
    assert all(torch.equal(a, b) for a, b in zip(ours["losses"], torch_run["losses"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], torch_run["params"], strict=True))
    # Where torch follows the setting, the gradients show it (a test that cannot pass vacuously).
    if FOLLOWS_GRAD_DTYPE and case in _ALL_FP32:
        assert all(dtype == torch.float32 for _, dtype, _ in ours["grads"][0])
    if FOLLOWS_GRAD_DTYPE and case == _MIXED:
        dtypes = {name: dtype for name, dtype, _ in ours["grads"][0]}
        assert dtypes["0.proj.weight"] == torch.bfloat16, dtypes
        assert dtypes["0.norm.weight"] == torch.float32, dtypes
    return True


_BEFORE_2_15 = "torch's own fully_shard fails its backward here before 2.15"


@pytest.mark.parametrize(
    "case",
    [
        "fp32",
        "norms_fp32",
        "any",
        "to_bf16",
        "no_sync",
        "assign",
        "hsdp",
        _MIXED,
        pytest.param(
            "set_after", marks=pytest.mark.skipif(not FOLLOWS_GRAD_DTYPE, reason=_BEFORE_2_15)
        ),
    ],
)
def test_grad_dtype_as_torch(case: str) -> None:
    assert run_on_ranks(2, _both, case=case) == [True, True]


def _unused_with_any_dtype(rank: int, world_size: int) -> list[str]:
    messages = []
    for engine in ("torch", "shardkit"):
        fully_shard = torch_fsdp.fully_shard if engine == "torch" else shardkit_core.fully_shard
        model: Any = _model().to(torch.bfloat16)
        _set_grad_dtype(model, "any")
        fully_shard(model)
        model.set_reduce_scatter_unused_params(True)
        with pytest.raises(ValueError, match=r"grad_dtype=None requires an explicit") as raised:
            model(torch.randn(4, _DIM).to(torch.bfloat16)).float().sum().backward()
        messages.append(str(raised.value))
    return messages


@pytest.mark.skipif(not FOLLOWS_GRAD_DTYPE, reason="torch before 2.15 ignores grad_dtype")
def test_unused_params_with_any_grad_dtype_raise_on_every_rank() -> None:
    results = run_on_ranks(2, _unused_with_any_dtype)
    assert all("proj.weight" in ours or "norm" in ours for _, ours in results)
