"""torch's Muon on sharded matrices is refused, naming the parameter and the fix."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from harness.pool import run_on_ranks
from shardkit.core.errors import ShardedMatrixError
from shardkit.core.optim.torch_muon import refuse_torch_muon_on_shards
from tests.core.optim.muon_runs import batch, build, full, loss_of, shard


def _refused_body(rank: int, world_size: int, impl: str, named: bool) -> dict[str, Any]:
    refuse_torch_muon_on_shards()  # as shardkit's fully_shard does: torch's engine is refused too
    model = build("mlp")
    shard(model, impl, world_size)
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    opt = torch.optim.Muon(matrices if named else [p for _, p in matrices], lr=0.02)
    x, y = batch("mlp", 0, rank, world_size)
    loss_of("mlp", model(x), y).backward()
    before = [full(p) for _, p in matrices]
    try:
        opt.step()
    except ShardedMatrixError as e:
        message = str(e)
    else:
        message = ""
    after = [full(p) for _, p in matrices]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {"message": message, "unchanged": unchanged}


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("named", [True, False])
def test_torch_muon_is_refused_on_shards(impl: str, named: bool) -> None:
    for out in run_on_ranks(2, _refused_body, impl=impl, named=named):
        assert out["unchanged"]
        # Named by the optimizer's names, or found in the modules fully_shard was given
        # (torch's engine's modules are not shardkit's: there it says where the parameter sits).
        name = "'inp.weight'" if named or impl == "shardkit" else "param_groups[0]['params'][0]"
        assert f"torch.optim.Muon was given {name}, a matrix sharded" in out["message"]
        assert "Use shardkit.core.optim.Muon" in out["message"]


def _whole_body(rank: int, world_size: int) -> bool:
    refuse_torch_muon_on_shards()
    model = build("one")  # a plain module: its matrix is whole on every rank
    mesh = init_device_mesh("cpu", (world_size,))
    replicated = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Replicate()]))
    weight = model.weight
    assert isinstance(weight, nn.Parameter)
    opt = torch.optim.Muon([weight, replicated], lr=0.02)
    weight.grad = torch.ones_like(weight)
    replicated.grad = distribute_tensor(torch.ones(4, 3), mesh, [Replicate()])
    opt.step()  # plain and replicated matrices are whole: torch's Muon is right there
    return True


def test_torch_muon_runs_on_whole_matrices() -> None:
    assert run_on_ranks(2, _whole_body) == [True, True]


_PATCHED_SCRIPT = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # bound before the patch
from torch.testing._internal.distributed.fake_pg import FakeStore
from shardkit.core import patch_torch
from shardkit.core.errors import ShardedMatrixError

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = torch.nn.Linear(4, 6, bias=False)
torch_fully_shard(model)  # torch's engine: shardkit's fully_shard never runs in this process
opt = torch.optim.Muon(model.parameters(), lr=0.02)
for when in ("before", "after"):
    if when == "after":
        patch_torch()
    try:
        opt.step()
    except ShardedMatrixError as error:
        print(when, "refused:", error)
    else:
        print(when, "ran")
"""


def test_patch_torch_refuses_torch_muon_on_torch_s_engine() -> None:
    argv = [sys.executable, "-c", _PATCHED_SCRIPT]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    before, after = done.stdout.splitlines()
    assert before == "before ran"  # nothing had installed the refusal: torch's own step
    assert after.startswith("after refused: torch.optim.Muon was given param_groups[0]")
