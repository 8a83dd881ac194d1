"""``set_keep_unsharded_storage(True)`` (torch 2.15's): full parameters keep their memory."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core.parity import fully_shard_of
from tests.core.torch_releases import torch_has

HIDDEN = 8
STEPS = 3


def _train(impl: str, keep: bool, rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 2)
    )
    fs = fully_shard_of(impl)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2], model[3]):
        fs(layer, mesh=mesh)
    root: Any = fs(model, mesh=mesh)
    if keep:
        root.set_keep_unsharded_storage(True)
    seen: list[torch.Tensor] = []  # the middle layer's full weight, as its forward sees it
    model[2].register_forward_pre_hook(lambda m, args: seen.append(m.weight))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, kept = [], []
    for step in range(STEPS):
        data = torch.Generator().manual_seed(100 * step + rank)
        x, target = torch.randn(4, HIDDEN, generator=data), torch.randn(4, 2, generator=data)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().clone())
        kept.append(seen[-1].untyped_storage().nbytes() > 0)  # resharded by now
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in full],
        "kept": kept,
        "addresses": {t.data_ptr() for t in seen},
    }


def _body(rank: int, world_size: int) -> dict[str, Any]:
    runs = {
        "shardkit": _train("shardkit", False, rank, world_size),
        "shardkit, kept": _train("shardkit", True, rank, world_size),
        "torch": _train("torch", False, rank, world_size),
    }
    if torch_has("FSDPModule.set_keep_unsharded_storage"):
        runs["torch, kept"] = _train("torch", True, rank, world_size)
    return runs


def test_kept_storage_keeps_its_addresses_and_trains_the_same() -> None:
    for runs in run_on_ranks(2, _body):
        kept = runs["shardkit, kept"]
        assert kept["kept"] == [True] * STEPS
        assert len(kept["addresses"]) == 1, "one address for every step's full weight"
        assert runs["shardkit"]["kept"] == [False] * STEPS  # freed as usual
        for name, run in runs.items():
            assert all(
                torch.equal(a, b) for a, b in zip(run["losses"], kept["losses"], strict=True)
            ), name
            assert all(
                torch.equal(a, b) for a, b in zip(run["params"], kept["params"], strict=True)
            ), name
            if name.startswith("torch"):
                assert run["kept"] == [name == "torch, kept"] * STEPS, name


def _switch_body(rank: int, world_size: int) -> list[bool]:
    model: Any = fully_shard_of("shardkit")(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2,)))
    model.set_keep_unsharded_storage(True)
    model(torch.ones(1, 4)).sum().backward()
    weight_in_forward = []
    model.register_forward_pre_hook(lambda m, args: weight_in_forward.append(m.weight))
    model(torch.ones(1, 4)).sum().backward()
    model.set_keep_unsharded_storage(False)  # from the next reshard on
    still = weight_in_forward[-1].untyped_storage().nbytes() > 0
    model(torch.ones(1, 4)).sum().backward()
    return [still, weight_in_forward[-1].untyped_storage().nbytes() > 0]


def test_false_frees_again_from_the_next_reshard() -> None:
    assert run_on_ranks(2, _switch_body) == [[True, False]] * 2
