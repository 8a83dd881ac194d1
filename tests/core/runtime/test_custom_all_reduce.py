"""``set_custom_all_reduce``: a user collective in place of the engine's all-reduce across replicas.

torch's ``fully_shard`` has no such setting (FSDP1's ``NO_SHARD`` communication hooks need it), so
the oracle is the engine's own all-reduce: a user collective that sums as c10d does trains bit
for bit the same, one that doubles the sum doubles every step, and clearing it goes back.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import FSDPModule, ReducePrecision, fully_shard


class _Summing:
    """An all-reduce through c10d, counting its calls; ``scale`` multiplies the sum."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.calls = 0
        self.group_sizes: set[int] = set()

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.calls += 1
        self.group_sizes.add(group.size())
        dist.all_reduce(tensor, group=group)
        if self.scale != 1.0:
            tensor.mul_(self.scale)


def _sharded(mesh: Any, comm: _Summing | None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_reduce(comm)
    return model


def _local(tensor: torch.Tensor | None) -> torch.Tensor:
    assert isinstance(tensor, DTensor)
    return tensor.to_local().detach().clone()


def _train(rank: int, world_size: int, shape: tuple[int, int]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {}
    for name, comm in (("engine", None), ("summing", _Summing()), ("doubling", _Summing(2.0))):
        model = _sharded(mesh, comm)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            torch.manual_seed(100 * step + rank)  # every rank its own data
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            if step == 0:
                out.setdefault("first_grads", {})[name] = [
                    _local(p.grad) for p in model.parameters()
                ]
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[name] = {
            "losses": losses,
            "params": [_local(p) for p in model.parameters()],
            "calls": None if comm is None else comm.calls,
            "group_sizes": None if comm is None else comm.group_sizes,
        }
    return out


@pytest.mark.parametrize("shape", [(2, 1), (2, 2)], ids=["replicate-2x1", "hsdp-2x2"])
def test_a_summing_collective_trains_as_the_engines_all_reduce(shape: tuple[int, int]) -> None:
    world_size = shape[0] * shape[1]
    for result in run_on_ranks(world_size, _train, shape=shape):
        engine, summing = result["engine"], result["summing"]
        assert summing["losses"] == engine["losses"]
        for ours, theirs in zip(summing["params"], engine["params"], strict=True):
            assert torch.equal(ours, theirs)
        # One call per group (two layers and the root's) per step, over the replicas.
        assert summing["calls"] == 3 * 3
        assert summing["group_sizes"] == {shape[0]}
        # Doubling the sum doubles the (mean) gradient the engine hands the optimizer.
        first = result["first_grads"]
        for doubled, plain in zip(first["doubling"], first["engine"], strict=True):
            torch.testing.assert_close(doubled, 2 * plain, rtol=1e-6, atol=0)


def _errors(rank: int, world_size: int) -> dict[str, str]:
    def message(call: Any) -> str:
        try:
            call()
        except ValueError as error:
            return str(error)
        return "no error"

    flat = init_device_mesh("cpu", (world_size,))
    hsdp = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    one_d = fully_shard(nn.Linear(4, 4), mesh=flat)
    compressed = fully_shard(nn.Linear(4, 4), mesh=hsdp)
    compressed.set_reduce_precision(ReducePrecision(wire_dtype=torch.bfloat16))
    custom = fully_shard(nn.Linear(4, 4), mesh=hsdp)
    custom.set_custom_all_reduce(_Summing())
    cleared = fully_shard(nn.Linear(4, 4), mesh=hsdp)
    cleared.set_custom_all_reduce(_Summing())
    cleared.set_custom_all_reduce(None)
    return {
        "1-D mesh": message(lambda: one_d.set_custom_all_reduce(_Summing())),
        "1-D mesh, cleared": message(lambda: one_d.set_custom_all_reduce(None)),
        "compressed first": message(lambda: compressed.set_custom_all_reduce(_Summing())),
        "custom first": message(
            lambda: custom.set_reduce_precision(ReducePrecision(wire_dtype=torch.bfloat16))
        ),
        "cleared, then compressed": message(
            lambda: cleared.set_reduce_precision(ReducePrecision(wire_dtype=torch.bfloat16))
        ),
    }


def test_refusals_name_the_module_and_the_conflict() -> None:
    messages = run_on_ranks(2, _errors)[0]
    assert "sharded on a 1-D mesh" in messages["1-D mesh"]
    assert "Linear" in messages["1-D mesh"]
    assert messages["1-D mesh, cleared"] == "no error"
    for case in ("compressed first", "custom first"):
        assert "custom all-reduce (set_custom_all_reduce)" in messages[case], case
    assert messages["cleared, then compressed"] == "no error"
